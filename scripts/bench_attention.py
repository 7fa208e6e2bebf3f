#!/usr/bin/env python3
"""Decode attention alone (cuda_src/attention_decode.cu + attention_combine.cu) over a BF16 and an INT8 cache, by context and split;
with --prefill, the prefill attention of one prompt (attention_wg.cu over a BF16 cache).

    python scripts/bench_attention.py [--models qwen3-4b] [--contexts 1024,32768] [--batch 1]
                                      [--splits 1,8,16,32,64] [--dtypes bf16,int8]
    python scripts/bench_attention.py --prefill 512,4096 [--models qwen3-4b]

For each model's attention shape (query heads, KV heads), context, batch and number of key-range
splits: microseconds per launch (attention + combine), the cache bytes one launch must read (keys
and values of every cached position, plus the INT8 scales) and GB/s, against the 4.3 TB/s read
ceiling (docs/benchmarks.md, Rooflines). One launch is one layer's attention of a decode step.

--prefill N: one N-token prompt attending causally to itself (its keys and values already in the paged
cache, as after attn_input): microseconds per launch and TFLOP/s (4 * 128 * heads * N (N + 1) / 2 flops, the
causal half of Q K^T and P V) against the 790 TFLOP/s bf16 ceiling (docs/benchmarks.md, Prefill).

Timing: `calls` launches in one CUDA graph (a Python launch costs ~9 us, more than a short kernel),
cycling through enough layers' pools to exceed the L2 cache, so every launch reads from HBM as a
decode step does; CUDA events around graph replays, median of --replays. Writes JSON to $OUT or --out.
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
from tileinfer.kernels import attention
from tileinfer.model.config import preset

ROOFLINE_BYTES_PER_S = 4.3e12
PEAK_FLOPS = 790e12
BF16 = np.dtype(ml_dtypes.bfloat16)
HD = 128
PAGE = 64


class Pools:
    """`copies` layers' K/V pools for `batch` sequences of `context` positions (pages shuffled)."""

    def __init__(self, KV: int, context: int, batch: int, int8: bool, copies: int, rng: np.random.Generator):
        pages_per_seq = -(-context // PAGE)
        num_pages = pages_per_seq * batch
        shape = (num_pages, KV, PAGE, HD)
        self.layers = []
        for _ in range(copies):
            if int8:
                codes = rng.integers(-127, 128, shape, dtype=np.int8)
                scales = (rng.random(shape[:3], dtype=np.float32) * 0.02).astype(np.float32)
                arrays = (DeviceArray.from_host(codes), DeviceArray.from_host(codes[::-1].copy()),
                          DeviceArray.from_host(scales), DeviceArray.from_host(scales))
            else:
                vals = rng.standard_normal(shape, dtype=np.float32).astype(BF16)
                arrays = (DeviceArray.from_host(vals), DeviceArray.from_host(vals[::-1].copy()))
            self.layers.append(arrays)
        table = rng.permutation(num_pages).astype(np.int32).reshape(batch, pages_per_seq)
        width = -(-pages_per_seq // 16) * 16
        self.tables = DeviceArray.from_host(np.pad(table, ((0, 0), (0, width - pages_per_seq))))
        self.kv_lens = DeviceArray.from_host(np.full(batch, context, np.int32))
        self.cu_q = DeviceArray.from_host(np.arange(batch + 1, dtype=np.int32))
        per_position = 2 * KV * (HD + 4 if int8 else 2 * HD)
        self.bytes_per_launch = per_position * context * batch

    def free(self) -> None:
        for arrays in self.layers:
            for a in arrays:
                a.free()
        for a in (self.tables, self.kv_lens, self.cu_q):
            a.free()


def time_launches(pools: Pools, H: int, splits: int, stream: Stream, calls: int, replays: int) -> float:
    batch = pools.kv_lens.shape[0]
    q = DeviceArray.from_host(np.random.default_rng(0).standard_normal((batch, H, HD), dtype=np.float32).astype(BF16))
    out = DeviceArray.empty((batch, H, HD), BF16)
    part_o = DeviceArray.empty((splits, batch, H, HD), np.float32)
    part_ml = DeviceArray.empty((splits, batch, H, 2), np.float32)

    def enqueue(s: Stream) -> None:
        for i in range(calls):
            layer = pools.layers[i % len(pools.layers)]
            attention(q, layer[0], layer[1], out, pools.cu_q, pools.kv_lens, pools.tables, max_q_len=1,
                      num_splits=splits, partials=(part_o, part_ml) if splits > 1 else None,
                      scales=(layer[2], layer[3]) if len(layer) == 4 else None, stream=s)

    try:
        return microseconds_per_call(stream, enqueue, calls, replays)
    finally:
        for a in (q, out, part_o, part_ml):
            a.free()


def time_prefill(pools: Pools, H: int, n: int, stream: Stream, calls: int, replays: int) -> float:
    q = DeviceArray.from_host(np.random.default_rng(0).standard_normal((n, H, HD), dtype=np.float32).astype(BF16))
    out = DeviceArray.empty((n, H, HD), BF16)
    cu_q = DeviceArray.from_host(np.array([0, n], np.int32))

    def enqueue(s: Stream) -> None:
        for i in range(calls):
            layer = pools.layers[i % len(pools.layers)]
            attention(q, layer[0], layer[1], out, cu_q, pools.kv_lens, pools.tables, max_q_len=n, stream=s)

    try:
        return microseconds_per_call(stream, enqueue, calls, replays)
    finally:
        for a in (q, out, cu_q):
            a.free()


def figure_line(row: dict) -> str:
    """A row as one line that scripts/ab.py reads as a figure (its markdown rows carry no units): the label, then
    TFLOP/s (prefill) or GB/s (decode) first, then the time."""
    if "tflop_s" in row:
        return f"prefill attention, {row['model']}, {row['prompt']}-token prompt: {row['tflop_s']:.0f} TFLOP/s " \
               f"({row['us']:.1f} us a launch)"
    return (f"decode attention, {row['model']} {row['dtype']}, batch {row['batch']}, {row['context']} positions, "
            f"{row['splits']} splits: {row['gb_s']:.0f} GB/s ({row['us']:.1f} us a launch)")


def table_head(title: str, columns: list[str]) -> None:
    print(f"# {title}")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def write_rows(out: Path, run: str, rows: list[dict]) -> None:
    print("\n".join(figure_line(row) for row in rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(run=run, rows=rows), indent=1))
    print(f"wrote {out}")


def attention_shapes(models: str):
    """(name, query heads, KV heads) of each model in the comma-separated list."""
    for name in models.split(","):
        c = preset(name)
        yield name, c.num_attention_heads, c.num_key_value_heads


def prefill_rows(args, stream: Stream, rng: np.random.Generator) -> list[dict]:
    table_head(f"prefill attention, one prompt, BF16 cache; page {PAGE}; TFLOP/s against {PEAK_FLOPS / 1e12:.0f}",
               ["model", "prompt", "us/launch", "TFLOP/s", "% of peak"])
    rows = []
    for name, H, KV in attention_shapes(args.models):
        for n in (int(x) for x in args.prefill.split(",")):
            pools = Pools(KV, n, 1, False, 4, rng)
            us = time_prefill(pools, H, n, stream, args.calls, args.replays)
            pools.free()
            flops = 4 * HD * H * n * (n + 1) / 2
            tflops = flops / us / 1e6
            rows.append(dict(model=name, prompt=n, us=us, flops=flops, tflop_s=tflops, peak_fraction=tflops * 1e12 / PEAK_FLOPS))
            print(f"| {name} | {n} | {us:.1f} | {tflops:.0f} | {100 * tflops * 1e12 / PEAK_FLOPS:.1f} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-4b")
    ap.add_argument("--contexts", default="1024,4096,32768")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--splits", default="1,8,16,32,64")
    ap.add_argument("--dtypes", default="bf16,int8")
    ap.add_argument("--calls", type=int, default=36, help="launches per graph (a model's layers)")
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--prefill", default="", help="prompt lengths: time prefill attention instead of decode")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    info = get_device().info
    run = run_header(f"{info.name}, {info.num_sms} SMs")
    print(f"Run: {run}", flush=True)
    stream = Stream()
    rng = np.random.default_rng(1)
    if args.prefill:
        rows = prefill_rows(args, stream, rng)
        write_rows(Path(args.out) / "bench_attention_prefill.json", run, rows)
        return
    table_head(f"decode attention on {info.name} ({info.num_sms} SMs); page {PAGE}; GB/s = cache bytes read / time; "
               f"roofline {ROOFLINE_BYTES_PER_S / 1e12:.1f} TB/s",
               ["model", "dtype", "batch", "context", "splits", "us/launch", "GB/s", "% roofline"])
    rows = []
    for name, H, KV in attention_shapes(args.models):
        for ctx in (int(x) for x in args.contexts.split(",")):
            for dtype in args.dtypes.split(","):
                int8 = dtype == "int8"
                per_layer = 2 * KV * (HD + 4 if int8 else 2 * HD) * ctx * args.batch
                copies = max(1, min(args.calls, math.ceil(3 * info.l2_bytes / per_layer)))
                pools = Pools(KV, ctx, args.batch, int8, copies, rng)
                for splits in (int(s) for s in args.splits.split(",")):
                    if splits > -(-ctx // 64):
                        continue
                    us = time_launches(pools, H, splits, stream, args.calls, args.replays)
                    gbs = pools.bytes_per_launch / us / 1e3
                    row = dict(model=name, dtype=dtype, batch=args.batch, context=ctx, splits=splits, us=us,
                               bytes=pools.bytes_per_launch, gb_s=gbs, roofline_fraction=gbs * 1e9 / ROOFLINE_BYTES_PER_S)
                    rows.append(row)
                    print(f"| {name} | {dtype} | {args.batch} | {ctx} | {splits} | {us:.1f} | {gbs:.0f} | "
                          f"{100 * row['roofline_fraction']:.1f} |", flush=True)
                pools.free()
    write_rows(Path(args.out) / "bench_attention.json", run, rows)


if __name__ == "__main__":
    main()
