#!/usr/bin/env python3
"""How fast the SMs pull bytes into shared memory, with nothing computed: the ceiling the batched products' k-steps
stream against (the TMA GEMM at 65-256 rows spends 80-96% of its time on its loads alone, about 65 GB/s an SM:
docs/benchmarks.md, "The batched products").

    python scripts/bench_ingest.py [--paths tensor,bulk,cp_async] [--data l2,hbm] [--sms 1,33,66,132]
                                   [--box-rows 96,128,224] [--stages 1,2,4,6]

One block on each of --sms SMs (its shared memory sized so that no second block fits) keeps `stages` copies of one
box in flight into a ring of that many stages, waiting for a stage's copy before it reuses the stage, for the run's
time. A box is box_rows x 64 bf16 (box_rows x 128 bytes; the TMA GEMM's W tile of a k-step is two boxes of 48-128
rows, its A tile two of 64-128). The copy paths:
- tensor: cp.async.bulk.tensor.2d through a tensor map with the 128-byte swizzle (the TMA GEMM's), one thread
  issuing, the boxes taken from a [rows, --cols] matrix as the GEMM takes W's k-steps (rows of --cols * 2 bytes);
- bulk: one 1-D cp.async.bulk of the same bytes, contiguous, one thread issuing;
- cp_async: 128 threads each copying its share in 16-byte cp.async pieces (the swap-AB GEMM's path), completing the
  stage's barrier through cp.async.mbarrier.arrive.noinc.
The data is --l2-mb megabytes (read again and again: L2-resident) or --hbm-mb (each box read once a run: from HBM).
Block b takes boxes b, b + blocks, ... of the data. Each configuration is launched once untimed, then --launches
times between two CUDA events. Prints a markdown table: GB/s in all and an SM, and the bytes in flight an SM
(stages x box); writes JSON to $OUT or --out.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
from cuda.bindings import driver

from bench import run_header
from tileinfer.cuda import I32, DeviceArray, Event, Kernel, Stream, call, compile_source, get_device
from tileinfer.cuda.module import device_arch
from tileinfer.cuda.tensormap import bf16_tensor_map

PATHS = ("tensor", "bulk", "cp_async")
THREADS = 128
MAX_RING = 200 * 1024  # the ring's bytes at most (the SM's 227 KB, less the static barriers and some slack)
ONE_BLOCK_SMEM = 120 * 1024  # at least this much dynamic shared memory a block: two never fit on one SM

SOURCE = r"""
#include "mbarrier.cuh"

struct alignas(64) TensorMapBytes { unsigned long long v[16]; };

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The bounded wait: a wrong phase would spin forever; after 2 s trap instead (the host sees a launch failure).
__device__ __forceinline__ void wait_stage(u32 bar, u32 parity) {
    if (mbar_try_wait(bar, parity)) return;
    const unsigned long long start = now_ns();
    while (!mbar_try_wait(bar, parity))
        if (now_ns() - start > 2000000000ull) __trap();
}

// path 0 tensor, 1 bulk, 2 cp_async; box = box_rows * 128 bytes; the data holds `boxes` boxes: for the tensor
// path a [rows, cols] bf16 matrix whose box k is rows (k / col_boxes) * box_rows.. and columns (k % col_boxes) *
// 64..; for the others box k is bytes k * box.. of src.
extern "C" __global__ void __launch_bounds__(128) ingest(const __grid_constant__ TensorMapBytes map,
        const char *__restrict__ src, int path, int box_rows, int col_boxes, int boxes, int stages, int iters) {
    extern __shared__ __align__(1024) unsigned char ring[];
    __shared__ __align__(8) unsigned long long bars[16];
    const u32 box = (u32)box_rows * 128u;
    const u32 ring0 = ((u32)__cvta_generic_to_shared(ring) + 1023u) & ~1023u;  // the swizzle's 1024-byte alignment
    if (threadIdx.x == 0)
        for (int s = 0; s < stages; ++s) mbar_init((u32)__cvta_generic_to_shared(&bars[s]), path == 2 ? 128 : 1);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (path != 2 && threadIdx.x != 0) return;
    for (int i = 0; i < iters; ++i) {
        const int s = i % stages;
        const u32 bar = (u32)__cvta_generic_to_shared(&bars[s]);
        if (i >= stages) wait_stage(bar, (u32)((i / stages - 1) & 1));  // copy i - stages has landed
        const int k = (int)(((long long)blockIdx.x + (long long)i * gridDim.x) % boxes);
        const u32 dst = ring0 + (u32)s * box;
        if (path == 0) {
            mbar_arrive_expect_tx(bar, box);
            const int c0 = (k % col_boxes) * 64, c1 = (k / col_boxes) * box_rows;
            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                         " [%0], [%1, {%3, %4}], [%2];"
                         ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(bar), "r"(c0), "r"(c1)
                         : "memory");
        } else if (path == 1) {
            mbar_arrive_expect_tx(bar, box);
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(dst), "l"(src + (size_t)k * box), "r"(box), "r"(bar) : "memory");
        } else {
            const char *from = src + (size_t)k * box;
            for (u32 at = threadIdx.x * 16u; at < box; at += 128u * 16u)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + at), "l"(from + at) : "memory");
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
        }
    }
    for (int i = iters > stages ? iters - stages : 0; i < iters; ++i)  // the last copies land before the block ends
        wait_stage((u32)__cvta_generic_to_shared(&bars[i % stages]), (u32)((i / stages) & 1));
}
"""


class _Cubin:
    """The probe's module (Kernel takes anything with .function)."""

    def __init__(self, cubin: bytes):
        self._image = cubin  # the driver reads it while loading
        self.handle = call(driver.cuModuleLoadData, cubin, detail="bench_ingest")

    def function(self, name: str):
        return call(driver.cuModuleGetFunction, self.handle, name.encode(), detail=name)


def compile_probe(arch: str) -> bytes:
    """The probe's cubin for `arch` (sm_90a: the bulk copies and their tensor maps are Hopper's)."""
    return compile_source("bench_ingest.cu", SOURCE, arch)


def plan(paths, data, sms, box_rows, stages, max_sms: int) -> list[dict]:
    """Every configuration, in the order run; those whose ring exceeds MAX_RING or that ask for more SMs than the
    GPU has are left out."""
    return [dict(path=p, data=d, sms=n, box_rows=r, stages=s)
            for p in paths for d in data for n in sms for r in box_rows for s in stages
            if s * r * 128 <= MAX_RING and n <= max_sms]


def render(rows: list[dict], run: str) -> str:
    lines = [f"Run: {run}. Bytes an SM pulls into shared memory, nothing computed (scripts/bench_ingest.py)", "",
             "| path | data | SMs | box KB | stages | in flight an SM, KB | GB/s | GB/s an SM | us a launch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        box = r["box_rows"] * 128
        lines.append(f"| {r['path']} | {r['data']} | {r['sms']} | {box / 1024:g} | {r['stages']} | "
                     f"{r['stages'] * box / 1024:g} | {r['GB_s']:,.0f} | {r['GB_s'] / r['sms']:.1f} | "
                     f"{r['us']:.1f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def ints(text):
        return [int(x) for x in text.split(",")]

    def names(allowed):
        def parse(text):
            got = text.split(",")
            if set(got) - set(allowed):
                raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}, got {text!r}")
            return got
        return parse

    ap.add_argument("--paths", type=names(PATHS), default=list(PATHS))
    ap.add_argument("--data", type=names(("l2", "hbm")), default=["l2", "hbm"])
    ap.add_argument("--sms", type=ints, default=[1, 33, 66, 132], help="blocks, one an SM")
    ap.add_argument("--box-rows", type=ints, default=[96, 128, 224], help="rows of 64 bf16 (128 bytes) a box")
    ap.add_argument("--stages", type=ints, default=[1, 2, 4, 6], help="copies in flight an SM (at most 16)")
    ap.add_argument("--cols", type=int, default=2560, help="columns of the tensor path's matrix (its row length)")
    ap.add_argument("--l2-mb", type=int, default=16, help="data read again and again (smaller than the L2)")
    ap.add_argument("--hbm-mb", type=int, default=4096, help="data read once a launch (far larger than the L2)")
    ap.add_argument("--mb-per-sm", type=int, default=64, help="megabytes each block pulls a launch")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    return ap


def main() -> None:
    args = parser().parse_args()
    if max(args.stages) > 16 or min(args.stages) < 1 or args.cols % 64 or any(r % 8 or r > 256 for r in args.box_rows):
        raise SystemExit("bench_ingest: --stages must be 1..16, --cols a multiple of 64 and --box-rows multiples of 8 "
                         "up to 256 (a box of whole 1,024-byte swizzle atoms)")
    dev = get_device()
    run = run_header(f"{dev.info.name}, {dev.info.num_sms} SMs")
    print(f"Run: {run}", flush=True)
    kernel = Kernel(_Cubin(compile_probe(device_arch())), "ingest")
    stream = Stream()
    buffers = {d: DeviceArray.zeros((mb << 20,), np.uint8, stream)
               for d, mb in (("l2", args.l2_mb), ("hbm", args.hbm_mb)) if d in args.data}
    rows = []
    for c in plan(args.paths, args.data, args.sms, args.box_rows, args.stages, dev.info.num_sms):
        data, box = buffers[c["data"]], c["box_rows"] * 128
        row_bytes = args.cols * 2
        mat_rows = data.nbytes // row_bytes // c["box_rows"] * c["box_rows"]  # whole boxes of rows
        col_boxes = args.cols // 64
        boxes = mat_rows // c["box_rows"] * col_boxes if c["path"] == "tensor" else data.nbytes // box
        tmap = bf16_tensor_map(data.ptr, mat_rows, args.cols, c["box_rows"])
        iters = max(c["stages"], (args.mb_per_sm << 20) // box)
        smem = max(c["stages"] * box, ONE_BLOCK_SMEM) + 1024  # the ring's alignment
        launch_args = [tmap, data, I32(PATHS.index(c["path"])), I32(c["box_rows"]), I32(col_boxes), I32(boxes),
                       I32(c["stages"]), I32(iters)]
        kernel.launch((c["sms"],), (THREADS,), launch_args, stream, smem)  # untimed
        start, end = Event(), Event()
        start.record(stream)
        for _ in range(args.launches):
            kernel.launch((c["sms"],), (THREADS,), launch_args, stream, smem)
        end.record(stream)
        end.synchronize()
        us = start.elapsed_ms(end) * 1e3 / args.launches
        rows.append(dict(c, box_bytes=box, iters=iters, us=us, GB_s=c["sms"] * iters * box / us / 1e3))
        print(f"{c}: {rows[-1]['GB_s']:,.0f} GB/s ({rows[-1]['GB_s'] / c['sms']:.1f} an SM)", flush=True)
    text = render(rows, run)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_ingest.json").write_text(json.dumps(dict(run=run, rows=rows), indent=1))
    (args.out / "bench_ingest.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
