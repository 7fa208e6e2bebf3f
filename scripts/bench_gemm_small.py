#!/usr/bin/env python3
"""linear()'s default path on the Qwen3 and Apertus decode and verify shapes (few rows: the GEMV, the swap-AB GEMM,
the TMA GEMM past 64 rows), with the alternatives beside it.

    python scripts/bench_gemm_small.py [--models qwen3-0.6b,qwen3-4b,qwen3-8b] [--m 5,16,32,64,128] [--swap]
                                       [--tma] [--cublas] [--matrices o,down]

For every weight matrix of the models (qkv bf16, o residual, [gate; up] silu_mul (Apertus: up xielu), down residual,
LM head f32) and every batch M: microseconds per call and GB/s of weight traffic (N * K * 2 bytes per call, the
bytes a decode step must read) for the default path (linear.default_path). --swap also times the swap-AB GEMM
(force="swap") at M <= 64 with every cluster split, marking the one swap_config picks (the sweep its rule was fitted
to); --tma the TMA GEMM (gemm_tma.cu) past 64 rows at every tile width and split (width 160 unsplit only, 96 also
split 2 and 4 ways; the persistent kernel's "s1" without a split last round or multicast), marking the (width,
split) tma_plan picks and, t2-t4, the split of the last round it adds, "mc" its multicast build (the default path's
time includes both); a split whose clusters do not all fit at once runs in more than one wave. --cublas times the
same product through PyTorch's torch.mm (cuBLAS, where PyTorch is installed: a peer, not a dependency), timed the
same way in a PyTorch CUDA graph over its own copies of W, with the name of the kernel cuBLAS chose. It is the bare
product with a bf16 output: no epilogue (TileInfer's gate/up also applies SiLU and the product, o and down add the
residual in float32), so it is a lower bound for what the same product would cost in a peer's step.

Timing: a Python launch costs ~9 us, more than many of these kernels, so `calls` launches are
captured into one CUDA graph and its replays are timed with CUDA events (median of --replays). The calls
cycle through enough copies of W to exceed the L2 cache three times over, so every call reads its
weights from HBM as in a decode step; x and out stay the same (they are hot in a real step too). --hot
keeps one copy of W instead, so that a matrix smaller than the L2 cache is read from there: what a product
would cost with its weights fetched into L2 beforehand.
x is the first M rows of a larger array, as in a step; --exact-x gives it exactly M rows, so that the TMA GEMM's
map of x ends at row M (linear.tile_rows otherwise runs it to a whole 128-row tile: the comparison behind it).
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

from bench import run_header
from graph_timing import microseconds_per_call
from tileinfer.cuda import DeviceArray, Stream, get_device
from tileinfer.kernels import linear
from tileinfer.kernels.linear import cluster_slots, gemm
from tileinfer.kernels.routing import (SWAP_BATCHES, SWAP_SPLITS, TMA_BM, TMA_ROUND_SPLITS,
                                       TMA_ROUND_WIDTHS, TMA_SPLITS, TMA_TALL, TMA_TALL_SPLITS, TMA_WIDTHS,
                                       default_path, swap_config, tma_plan)
from tileinfer.model.config import preset

ROOFLINE_BYTES_PER_S = 4.3e12  # the H200's measured read bandwidth (docs/benchmarks.md, Rooflines)
BF16 = np.dtype(ml_dtypes.bfloat16)


def model_matrices(name: str) -> list[tuple[str, int, int, str]]:
    """(matrix, N, K, epilogue) of one layer of the model, plus the LM head."""
    c = preset(name)
    d, f = c.hidden_size, c.intermediate_size
    up = ("gate_up", 2 * f, d, "silu_mul") if c.mlp == "gated_silu" else ("up", f, d, "xielu")  # Apertus: xIELU
    return [("qkv", c.qkv_size, d, "bf16"), ("o", d, c.q_size, "residual"), up, ("down", d, f, "residual"),
            ("lm_head", c.vocab_size, d, "f32")]


XIELU_PARAMS = (0.8, 0.8, 0.5, -1e-6)  # the "xielu" epilogue's [a_p, a_n, beta, eps]: finite, of no cost of their own


class Case:
    """Device buffers for one (N, K, epilogue): copies of W, and x / out for the largest M."""

    def __init__(self, N: int, K: int, epilogue: str, max_m: int, l2_bytes: int, rng: np.random.Generator,
                 hot: bool = False):
        self.N, self.K, self.epilogue = N, K, epilogue
        self.w_bytes = N * K * 2
        w = (rng.standard_normal((N, K), dtype=np.float32) / np.float32(math.sqrt(K))).astype(BF16)
        copies = 1 if hot else max(2, math.ceil(3 * l2_bytes / self.w_bytes))
        self.weights = [DeviceArray.from_host(w) for _ in range(copies)]
        self.x = DeviceArray.from_host(rng.standard_normal((max_m, K), dtype=np.float32).astype(BF16))
        cols = N // 2 if epilogue == "silu_mul" else N
        dtype = np.float32 if epilogue in ("residual", "f32") else BF16
        self.out = DeviceArray.zeros((max_m, cols), dtype)
        self.act = DeviceArray.from_host(np.array(XIELU_PARAMS, np.float32)) if epilogue == "xielu" else None

    def free(self) -> None:
        for a in (*self.weights, self.x, self.out, self.act):
            if a is not None:
                a.free()


def time_calls(case: Case, M: int, stream: Stream, calls: int, replays: int, exact_x: bool = False, fn=linear,
               **linear_kwargs) -> float:
    """Microseconds per linear() call (or `fn`'s, with linear's first five arguments): `calls` launches in one
    graph, median over `replays` replays. x is the first M rows of the case's x (as in a step, rows of a larger
    workspace), or with exact_x an array of its own of exactly M rows (the TMA GEMM's map of x then cannot run
    to a whole tile: linear.tile_rows)."""
    x, out = case.x.rows(0, M), case.out.rows(0, M)
    if exact_x:
        x = DeviceArray.empty((M, case.K), BF16)
        x.copy_from_host(case.x.rows(0, M).to_host())

    if case.act is not None:
        linear_kwargs["act"] = case.act

    def enqueue(s: Stream) -> None:
        for i in range(calls):
            fn(x, case.weights[i % len(case.weights)], out, case.epilogue, s, **linear_kwargs)

    try:
        return microseconds_per_call(stream, enqueue, calls, replays)
    finally:
        if exact_x:
            stream.synchronize()
            x.free()


class CublasCase:
    """The peer's side of a Case: PyTorch tensors of the same shapes, W cycled through as many copies."""

    def __init__(self, case: Case, max_m: int):
        import torch  # the peer's library, only for --cublas

        self.torch = torch
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(case.N, case.K, device="cuda", generator=gen).div_(math.sqrt(case.K)).bfloat16()
        self.weights = [w.clone() for _ in range(len(case.weights))]
        self.x = torch.randn(max_m, case.K, device="cuda", generator=gen).bfloat16()
        self.out = torch.empty(max_m, case.N, device="cuda", dtype=torch.bfloat16)

    def kernel(self, M: int) -> str:
        """The name of the kernel (or kernels, joined by '+') one torch.mm of M rows launches."""
        torch = self.torch
        x, out = self.x[:M], self.out[:M]
        torch.mm(x, self.weights[0].t(), out=out)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.mm(x, self.weights[0].t(), out=out)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return "+".join(dict.fromkeys(names)) or "?"

    def time(self, M: int, calls: int, replays: int) -> float:
        """Microseconds per torch.mm: `calls` of them in one CUDA graph, the median of `replays` timed replays."""
        torch = self.torch
        x, out = self.x[:M], self.out[:M]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture (cuBLAS's handle and workspace)
            for i in range(3):
                torch.mm(x, self.weights[i % len(self.weights)].t(), out=out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                torch.mm(x, self.weights[i % len(self.weights)].t(), out=out)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        del graph
        return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b,qwen3-8b")
    ap.add_argument("--m", default="5,16,32,64,128", help="batch sizes (rows of x)")
    ap.add_argument("--swap", action="store_true", help="also time the swap-AB GEMM (force='swap') with every "
                    "split where M <= 64")
    ap.add_argument("--tma", action="store_true", help="also time the TMA GEMM at every tile width and split "
                    "where M > 64")
    ap.add_argument("--cublas", action="store_true", help="also time torch.mm (cuBLAS, where PyTorch is installed) "
                    "on the same shapes, and name its kernel")
    ap.add_argument("--no-lm-head", action="store_true", help="skip the LM head (the largest matrix)")
    ap.add_argument("--matrices", default=None, help="only these matrices (comma-separated of qkv, o, gate_up, up, "
                    "down, lm_head)")
    ap.add_argument("--exact-x", action="store_true", help="x an array of exactly M rows (not a view of a larger "
                    "one): the TMA GEMM's map of x ends at row M")
    ap.add_argument("--hot", action="store_true", help="one copy of W, read from the L2 cache where it fits")
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--graph-bytes", type=float, default=4e9, help="weight bytes one graph replay reads")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    ms = [int(m) for m in args.m.split(",")]
    if args.cublas:
        try:
            import torch  # noqa: F401 (CublasCase imports it again, where it is used)
        except ImportError:
            ap.error("--cublas times torch.mm through PyTorch, which is not installed here: install torch, or leave "
                     "--cublas out")

    dev = get_device()
    info = dev.info
    run = run_header(f"{info.name}, {info.num_sms} SMs")
    print(f"Run: {run}")
    print(f"# linear's default path on {info.name} ({info.num_sms} SMs, L2 {info.l2_bytes >> 20} MB; TMA GEMM blocks "
          f"resident at once by split: {cluster_slots()}), bf16 weights, "
          f"float32 accumulation; GB/s = weight bytes / time; roofline {ROOFLINE_BYTES_PER_S / 1e12:.1f} TB/s; "
          f"{'one copy of W (hot in L2 where it fits)' if args.hot else 'W cycled through copies of 3x the L2'}")
    stream = Stream()
    rng = np.random.default_rng(0)
    rows = []
    header = "| model | matrix | N x K | epilogue | M | default | us | GB/s | roofline |"
    if args.swap:
        header += " swap split | " + " | ".join(f"swap ks{k} us" for k in SWAP_SPLITS) + " |"
    tma_options = [(TMA_BM, w, ks) for w in TMA_WIDTHS for ks in (1,) + TMA_SPLITS]
    tma_options += [(TMA_BM, w, 1) for w in TMA_ROUND_WIDTHS]
    tma_options += [(TMA_BM, w, ks) for w, splits in TMA_ROUND_SPLITS.items() for ks in splits]
    tma_options += [(TMA_TALL, w, ks) for w, splits in TMA_TALL_SPLITS.items() for ks in splits]
    label = lambda r, w, ks: f"{'m256 ' if r == TMA_TALL else ''}{w} s{ks}"  # noqa: E731
    if args.tma:
        header += " tma pick | " + " | ".join(f"tma {label(*o)} us" for o in tma_options) + " |"
    if args.cublas:
        header += " cuBLAS us | cuBLAS TFLOP/s | default TFLOP/s | cuBLAS kernel |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for model in args.models.split(","):
        for matrix, N, K, epilogue in model_matrices(model):
            if (args.no_lm_head and matrix == "lm_head") or (args.matrices and matrix not in args.matrices.split(",")):
                continue
            case = Case(N, K, epilogue, max(ms), info.l2_bytes, rng, args.hot)
            peer = CublasCase(case, max(ms)) if args.cublas else None
            calls = int(min(400, max(10, args.graph_bytes // case.w_bytes)))
            gbs = lambda us: case.w_bytes / us / 1e3  # noqa: E731 (bytes per microsecond -> GB/s)
            try:
                for M in ms:
                    default = default_path(M, N, K, epilogue, info.num_sms)
                    t_default = time_calls(case, M, stream, calls, args.replays, exact_x=args.exact_x)
                    row = dict(model=model, matrix=matrix, N=N, K=K, epilogue=epilogue, M=M, default=default,
                               default_us=t_default, default_GB_s=gbs(t_default),
                               roofline_fraction=gbs(t_default) * 1e9 / ROOFLINE_BYTES_PER_S,
                               calls_per_graph=calls, weight_copies=len(case.weights))
                    line = (f"| {model} | {matrix} | {N} x {K} | {epilogue} | {M} | {default} | {t_default:.1f} "
                            f"| {row['default_GB_s']:.0f} | {row['roofline_fraction']:.0%} |")
                    if args.swap:
                        if M <= SWAP_BATCHES[-1]:
                            picked = swap_config(M, N, K, epilogue, sms=info.num_sms).ksplit
                            swap = {ks: time_calls(case, M, stream, calls, args.replays, force="swap", ksplit=ks)
                                    for ks in SWAP_SPLITS}
                            row.update(swap_split=picked, swap_us={str(k): v for k, v in swap.items()})
                            line += f" {picked} | " + " | ".join(f"{swap[k]:.1f}" for k in SWAP_SPLITS) + " |"
                        else:
                            line += " - |" + " - |" * len(SWAP_SPLITS)
                    if args.tma:
                        if M > SWAP_BATCHES[-1]:
                            pick = tma_plan(M, N, K, epilogue, info.num_sms, cluster_slots())
                            tma = {(r, w, ks): time_calls(case, M, stream, calls, args.replays, exact_x=args.exact_x,
                                                          fn=gemm, width=w, split=ks, rows=r)
                                   for r, w, ks in tma_options}
                            row.update(tma_pick=[pick.width, pick.split, pick.tail, pick.multicast, pick.rows],
                                       tma_us={(f"m{r}n" if r == TMA_TALL else "") + f"{w}s{ks}": v
                                               for (r, w, ks), v in tma.items()})
                            tail = (f" t{pick.tail}" if pick.tail > 1 else "") + (" mc" if pick.multicast else "")
                            line += (f" {label(pick.rows, pick.width, pick.split)}{tail} | "
                                     + " | ".join(f"{tma[o]:.1f}" for o in tma_options) + " |")
                        else:
                            line += " - |" + " - |" * len(tma_options)
                    if peer is not None:
                        t_peer = peer.time(M, calls, args.replays)
                        tflops = lambda us: 2 * M * N * K / us / 1e6  # noqa: E731 (flop per microsecond -> TFLOP/s)
                        row.update(cublas_us=t_peer, cublas_kernel=peer.kernel(M))
                        line += (f" {t_peer:.1f} | {tflops(t_peer):.0f} | {tflops(t_default):.0f} "
                                 f"| {row['cublas_kernel']} |")
                    rows.append(row)
                    print(line, flush=True)
            finally:
                stream.synchronize()
                case.free()
                del peer
    stream.destroy()
    path = Path(args.out) / "bench_gemm_small.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(run=run, gpu=info.name, sms=info.num_sms, roofline_bytes_per_s=ROOFLINE_BYTES_PER_S,
                                    exact_x=args.exact_x, hot=args.hot, rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
