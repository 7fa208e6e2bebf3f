#!/usr/bin/env python3
"""The small-M GEMM (cuda_src/gemm_small.cu) against linear()'s default path on the Qwen3 decode shapes.

    python scripts/bench_gemm_small.py [--models qwen3-0.6b,qwen3-4b,qwen3-8b] [--m 16,32,64,128,256] [--sweep]

For every weight matrix of the models (qkv bf16, o residual, [gate; up] silu_mul, down residual, LM head
f32) and every batch M: microseconds per call and GB/s of weight traffic (N * K * 2 bytes per call, the
bytes a decode step must read) for the default path (linear.default_path: the GEMVs, the swap-AB, small or
TMA GEMM) and
for linear(force="small") with the split small_gemm_config picks; --sweep also times every cluster split.
--swap also times the swap-AB GEMM (force="swap") at M <= 64 with the split swap_config picks and with
every split (the sweep its rule was fitted to; e.g. --m 5 --models qwen3-8b --tc --swap for verify steps).

Timing: a Python launch costs ~9 us (GPU.md), more than many of these kernels, so `calls` launches are
captured into one CUDA graph and its replays are timed with CUDA events (median of --replays). The calls
cycle through enough copies of W to exceed the L2 cache three times over, so every call reads its
weights from HBM as in a decode step; x and out stay the same (they are hot in a real step too).
Prints a markdown table (GPU, dtype bf16, fraction of the 4.3 TB/s roofline) and writes JSON to $OUT or --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np

from graph_timing import microseconds_per_call
from tileinfer.cuda import DeviceArray, Stream, get_device
from tileinfer.kernels import linear
from tileinfer.kernels.linear import (GEMV_ROWS, SMALL_ROWS, SMALL_SPLITS, SWAP_BATCHES, SWAP_SPLITS, TC_MAX_ROWS,
                                      default_path, small_gemm_config, swap_config)
from tileinfer.model.config import preset

ROOFLINE_BYTES_PER_S = 4.3e12  # measured read bandwidth of the H200 (../shared/GPU.md)
BF16 = np.dtype(ml_dtypes.bfloat16)


def model_matrices(name: str) -> list[tuple[str, int, int, str]]:
    """(matrix, N, K, epilogue) of one layer of the model, plus the LM head."""
    c = preset(name)
    d, f = c.hidden_size, c.intermediate_size
    return [("qkv", c.qkv_size, d, "bf16"), ("o", d, c.q_size, "residual"), ("gate_up", 2 * f, d, "silu_mul"),
            ("down", d, f, "residual"), ("lm_head", c.vocab_size, d, "f32")]


class Case:
    """Device buffers for one (N, K, epilogue): copies of W, and x / out for the largest M."""

    def __init__(self, N: int, K: int, epilogue: str, max_m: int, l2_bytes: int, rng: np.random.Generator):
        self.N, self.K, self.epilogue = N, K, epilogue
        self.w_bytes = N * K * 2
        w = (rng.standard_normal((N, K), dtype=np.float32) / np.float32(math.sqrt(K))).astype(BF16)
        copies = max(2, math.ceil(3 * l2_bytes / self.w_bytes))
        self.weights = [DeviceArray.from_host(w) for _ in range(copies)]
        self.x = DeviceArray.from_host(rng.standard_normal((max_m, K), dtype=np.float32).astype(BF16))
        cols = N // 2 if epilogue == "silu_mul" else N
        dtype = np.float32 if epilogue in ("residual", "f32") else BF16
        self.out = DeviceArray.zeros((max_m, cols), dtype)

    def free(self) -> None:
        for a in (*self.weights, self.x, self.out):
            a.free()


def time_calls(case: Case, M: int, stream: Stream, calls: int, replays: int, **linear_kwargs) -> float:
    """Microseconds per linear() call: `calls` launches in one graph, median over `replays` replays."""
    x, out = case.x.rows(0, M), case.out.rows(0, M)

    def enqueue(s: Stream) -> None:
        for i in range(calls):
            linear(x, case.weights[i % len(case.weights)], out, case.epilogue, s, **linear_kwargs)

    return microseconds_per_call(stream, enqueue, calls, replays)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b,qwen3-8b")
    ap.add_argument("--m", default="16,32,64,128,256", help="batch sizes (rows of x)")
    ap.add_argument("--sweep", action="store_true", help="also time every cluster split of the small GEMM")
    ap.add_argument("--sweep-rows", action="store_true", help="also time every (M tile, split) pair")
    ap.add_argument("--gemv", action="store_true", help="also time the GEMV (force='gemv') where M <= 8")
    ap.add_argument("--tc", action="store_true", help="also time the tensor-core GEMV (force='tc') where M <= 16")
    ap.add_argument("--swap", action="store_true", help="also time the swap-AB GEMM (force='swap'), its own "
                    "split and every split, where M <= 64")
    ap.add_argument("--no-lm-head", action="store_true", help="skip the LM head (the largest matrix)")
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--graph-bytes", type=float, default=4e9, help="weight bytes one graph replay reads")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    ms = [int(m) for m in args.m.split(",")]

    dev = get_device()
    info = dev.info
    print(f"# gemm_small vs default linear path on {info.name} ({info.num_sms} SMs, L2 {info.l2_bytes >> 20} MB), "
          f"bf16 weights, float32 accumulation; GB/s = weight bytes / time; roofline {ROOFLINE_BYTES_PER_S / 1e12:.1f} TB/s")
    stream = Stream()
    rng = np.random.default_rng(0)
    rows = []
    header = ("| model | matrix | N x K | epilogue | M | default | us | GB/s | small (rows, ksplit, grid) | us | GB/s "
              "| roofline | speedup |" + (" " + " ".join(f"ks{k} us |" for k in SMALL_SPLITS) if args.sweep else ""))
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for model in args.models.split(","):
        for matrix, N, K, epilogue in model_matrices(model):
            if args.no_lm_head and matrix == "lm_head":
                continue
            case = Case(N, K, epilogue, max(ms), info.l2_bytes, rng)
            calls = int(min(400, max(10, args.graph_bytes // case.w_bytes)))
            try:
                for M in ms:
                    default = default_path(M, N)
                    cfg = small_gemm_config(M, N, K, sms=info.num_sms)
                    t_default = time_calls(case, M, stream, calls, args.replays)
                    t_small = time_calls(case, M, stream, calls, args.replays, force="small")
                    sweep = {ks: time_calls(case, M, stream, calls, args.replays, force="small", ksplit=ks)
                             for ks in SMALL_SPLITS} if args.sweep else {}
                    if args.sweep_rows:
                        for r in SMALL_ROWS:
                            for ks in SMALL_SPLITS:
                                us = time_calls(case, M, stream, calls, args.replays, force="small", ksplit=ks, rows=r)
                                print(f"  sweep {model} {matrix} M={M} rows={r} ksplit={ks}: {us:.1f} us", flush=True)
                    gbs = lambda us: case.w_bytes / us / 1e3  # noqa: E731 (bytes per microsecond -> GB/s)
                    t_gemv = None
                    if args.gemv and M in GEMV_ROWS:
                        t_gemv = time_calls(case, M, stream, calls, args.replays, force="gemv")
                        print(f"  gemv {model} {matrix} M={M}: {t_gemv:.1f} us, {gbs(t_gemv):.0f} GB/s", flush=True)
                    t_tc = None
                    if args.tc and M <= TC_MAX_ROWS:
                        t_tc = time_calls(case, M, stream, calls, args.replays, force="tc")
                        print(f"  tc {model} {matrix} M={M}: {t_tc:.1f} us, {gbs(t_tc):.0f} GB/s", flush=True)
                    swap = {}
                    if args.swap and M <= SWAP_BATCHES[-1]:
                        picked = swap_config(M, N, K, epilogue, sms=info.num_sms).ksplit
                        swap = {ks: time_calls(case, M, stream, calls, args.replays, force="swap", ksplit=ks)
                                for ks in SWAP_SPLITS}
                        print(f"  swap {model} {matrix} M={M}: split {picked} (the rule's) {swap[picked]:.1f} us, "
                              f"{gbs(swap[picked]):.0f} GB/s; every split: "
                              + ", ".join(f"{ks}: {us:.1f}" for ks, us in swap.items()), flush=True)
                    row = dict(model=model, matrix=matrix, N=N, K=K, epilogue=epilogue, M=M, default=default,
                               default_us=t_default, default_GB_s=gbs(t_default), small_rows=cfg.rows,
                               small_ksplit=cfg.ksplit, small_grid=cfg.grid, small_us=t_small,
                               small_GB_s=gbs(t_small), roofline_fraction=gbs(t_small) * 1e9 / ROOFLINE_BYTES_PER_S,
                               speedup=t_default / t_small, gemv_us=t_gemv, tc_us=t_tc, sweep_us={str(k): v for k, v in sweep.items()},
                               swap_us={str(k): v for k, v in swap.items()},
                               calls_per_graph=calls, weight_copies=len(case.weights))
                    rows.append(row)
                    line = (f"| {model} | {matrix} | {N} x {K} | {epilogue} | {M} | {default} | {t_default:.1f} "
                            f"| {row['default_GB_s']:.0f} | {cfg.rows}, {cfg.ksplit}, {cfg.grid} | {t_small:.1f} "
                            f"| {row['small_GB_s']:.0f} | {row['roofline_fraction']:.0%} | {row['speedup']:.2f}x |")
                    if sweep:
                        line += " " + " ".join(f"{sweep[k]:.1f} |" for k in SMALL_SPLITS)
                    print(line, flush=True)
            finally:
                stream.synchronize()
                case.free()
    stream.destroy()
    path = Path(args.out) / "bench_gemm_small.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(gpu=info.name, sms=info.num_sms, roofline_bytes_per_s=ROOFLINE_BYTES_PER_S,
                                    rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
