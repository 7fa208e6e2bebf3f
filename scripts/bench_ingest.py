#!/usr/bin/env python3
"""How fast the SMs pull bytes into shared memory, with nothing computed: the ceiling the batched products' k-steps
stream against (the TMA GEMM at 65-256 rows spends 80-96% of its time on its loads alone, about 65 GB/s an SM:
docs/benchmarks.md, "The batched products").

    python scripts/bench_ingest.py [--paths tensor,bulk,cp_async] [--data l2,hbm] [--sms 1,33,66,132]
                                   [--box-rows 96,128,224] [--stages 1,2,4,6] [--depth 1] [--copies 1]
                                   [--issuers one,lanes]

One block on each of --sms SMs (its shared memory sized so that no second block fits) keeps `stages` stages in
flight in a ring of that many, waiting for a stage's copies before it reuses the stage, for the run's time. A stage
is --copies boxes; a box is box_rows x 64 bf16 (box_rows x 128 bytes; the TMA GEMM's W tile of a k-step is two boxes
of 32-128 rows, its A tile one or two of 128), or with --depth d > 1 (the tensor path) d such slices of consecutive
64-column blocks, one 3-D copy (a GEMM stage d k-steps deep). The copy paths:
- tensor: cp.async.bulk.tensor through a tensor map with the 128-byte swizzle (the TMA GEMM's), the boxes taken from
  a [rows, --cols] matrix as the GEMM takes W's k-steps (rows of --cols * 2 bytes);
- bulk: one 1-D cp.async.bulk of the same bytes, contiguous;
- cp_async: 128 threads each copying its share in 16-byte cp.async pieces (the swap-AB GEMM's path), completing the
  stage's barrier through cp.async.mbarrier.arrive.noinc;
- tensor_mc: the tensor path in 2-block clusters that share their boxes (as the TMA GEMM's multicast build shares
  W tiles): each block issues half a stage's copies, multicast into both, so L2 serves half the bytes the SMs
  receive (GB/s counts the bytes received).
The tensor and bulk copies of a stage are issued by thread 0 one after the other (--issuers one) or by lanes 0 ..
copies - 1 of warp 0, one each (lanes).
The data is --l2-mb megabytes (read again and again: L2-resident) or --hbm-mb (each box read once a run: from HBM).
Block b takes boxes b, b + blocks, ... of the data. Each configuration is launched once untimed, then --launches
times between two CUDA events. Prints a markdown table: GB/s in all and an SM, the bytes in flight an SM, and the
time a copy takes an SM (its bytes over the SM's rate); writes JSON to $OUT or --out.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
from pathlib import Path

import numpy as np
from cuda.bindings import driver

from bench import run_header
from tileinfer.cuda import I32, DeviceArray, Event, Kernel, Stream, call, compile_source, get_device
from tileinfer.cuda.module import device_arch
from tileinfer.cuda.tensormap import TensorMap, bf16_tensor_map

PATHS = ("tensor", "bulk", "cp_async", "tensor_mc")
THREADS = 128
MAX_RING = 200 * 1024  # the ring's bytes at most (the SM's 227 KB, less the static barriers and some slack)
ONE_BLOCK_SMEM = 120 * 1024  # at least this much dynamic shared memory a block: two never fit on one SM

SOURCE = r"""
#include "cluster.cuh"
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

// Box k of the data, stepped along rather than divided out (a 64-bit modulo and two divisions a copy cost one
// issuing thread some 400 ns, which would set the pace whatever the stages): the divisions happen once, in start.
// For the tensor path box k is (kr, kc) = (k / col_boxes, k % col_boxes) of its grid of boxes.
struct Cursor {
    int k, kc, kr;          // the box now
    int n, nc, nr;          // a step: n boxes, n / col_boxes rows of boxes and n % col_boxes more
    int boxes, col_boxes, row_boxes;
    __device__ void start(int at, int step_boxes, int boxes_, int col_boxes_) {
        boxes = boxes_;
        col_boxes = col_boxes_;
        row_boxes = max(1, boxes / col_boxes);
        k = at % boxes;
        kc = k % col_boxes;
        kr = k / col_boxes % row_boxes;
        n = step_boxes % boxes;
        nc = n % col_boxes;
        nr = n / col_boxes;
    }
    __device__ void step() {  // k += n modulo boxes, with no division
        k += n;
        if (k >= boxes) k -= boxes;
        kc += nc;
        kr += nr;
        if (kc >= col_boxes) { kc -= col_boxes; ++kr; }
        if (kr >= row_boxes) kr -= row_boxes;
    }
};

// path 0 tensor, 1 bulk, 2 cp_async. A box is box_rows x 64 bf16 x depth; a stage `copies` boxes. The tensor
// path's data is a [rows, cols] bf16 matrix: box (kr, kc) is rows kr * box_rows.. and columns kc * 64 * depth..,
// through map2 (depth 1, a 2-D copy) or map3 (a 3-D copy of `depth` 64-column slices, each [box_rows][64] in shared
// memory, one after the other: a GEMM stage `depth` k-steps deep). For the others box k is bytes k * box.. of src.
// lanes: lane j of warp 0 issues copy j of each stage; else thread 0 issues them all.
extern "C" __global__ void __launch_bounds__(128) ingest(const __grid_constant__ TensorMapBytes map2,
        const __grid_constant__ TensorMapBytes map3, const char *__restrict__ src, int path, int box_rows, int depth,
        int col_boxes, int boxes, int copies, int lanes, int stages, int iters) {
    extern __shared__ __align__(1024) unsigned char ring[];
    __shared__ __align__(8) unsigned long long bars[16];
    const u32 box = (u32)box_rows * 128u * (u32)depth;
    const u32 stage_bytes = box * (u32)copies;
    const u32 ring0 = ((u32)__cvta_generic_to_shared(ring) + 1023u) & ~1023u;  // the swizzle's 1024-byte alignment
    if (threadIdx.x == 0)
        for (int s = 0; s < stages; ++s) mbar_init((u32)__cvta_generic_to_shared(&bars[s]), path == 2 ? 128 : 1);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int lane = threadIdx.x & 31;
    if (path != 2 && (threadIdx.x >= 32 || (!lanes && lane != 0))) return;
    const bool issues = path == 2 || !lanes || lane < copies;
    const int g = (int)gridDim.x;
    Cursor at;  // lanes: lane j takes copy j of each stage; else the one thread takes them one after the other
    at.start((int)blockIdx.x + (path != 2 && lanes ? lane * g : 0), path != 2 && lanes ? g * copies : g, boxes,
             col_boxes);
    int s = 0;
    u32 parity = 0;  // the phase parity of the copies now issued into the ring's stages
    for (int i = 0; i < iters; ++i) {
        const u32 bar = (u32)__cvta_generic_to_shared(&bars[s]);
        if (i >= stages) wait_stage(bar, parity ^ 1u);  // stage i - stages has landed
        const u32 dst = ring0 + (u32)s * stage_bytes;
        if (path == 2) {
            for (int j = 0; j < copies; ++j) {
                const char *from = src + (size_t)at.k * box;
                for (u32 b = threadIdx.x * 16u; b < box; b += 128u * 16u)
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + j * box + b), "l"(from + b)
                                 : "memory");
                at.step();
            }
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
        } else {
            if (lane == 0) mbar_arrive_expect_tx(bar, stage_bytes);
            if (lanes) __syncwarp();
            for (int j = lanes ? lane : 0; issues && j < (lanes ? lane + 1 : copies); ++j) {
                const u32 to = dst + (u32)j * box;
                if (path == 1)
                    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                                 ::"r"(to), "l"(src + (size_t)at.k * box), "r"(box), "r"(bar) : "memory");
                else if (depth == 1)
                    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                                 " [%0], [%1, {%3, %4}], [%2];"
                                 ::"r"(to), "l"(reinterpret_cast<unsigned long long>(&map2)), "r"(bar),
                                   "r"(at.kc * 64), "r"(at.kr * box_rows)
                                 : "memory");
                else
                    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                                 " [%0], [%1, {%3, %4, %5}], [%2];"
                                 ::"r"(to), "l"(reinterpret_cast<unsigned long long>(&map3)), "r"(bar), "r"(0),
                                   "r"(at.kr * box_rows), "r"(at.kc * depth)
                                 : "memory");
                at.step();
            }
        }
        if (++s == stages) { s = 0; parity ^= 1u; }
    }
    // the last stages land before the block ends: stage i sits in slot i % stages with parity (i / stages) & 1
    for (int i = iters > stages ? iters - stages : 0; i < iters; ++i)
        wait_stage((u32)__cvta_generic_to_shared(&bars[i % stages]), (u32)((i / stages) & 1));
}

// The tensor path in 2-block clusters sharing their boxes (the TMA GEMM's multicast build shares W tiles so):
// copy j of a stage is issued by the block of rank j % 2 and multicast into both, so each block receives the
// stage's `copies` boxes while L2 serves each box once. A stage is overwritten only once both blocks hold its last
// round: each block arrives on both blocks' "empty" barrier of the stage (2 arrivals) once its "full" one completes.
// The pair p = blockIdx.x / 2 takes boxes p, p + pairs, ... of the matrix.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(128) ingest_mc(
        const __grid_constant__ TensorMapBytes map2, int box_rows, int col_boxes, int boxes, int copies, int stages,
        int iters) {
    extern __shared__ __align__(1024) unsigned char ring[];
    __shared__ __align__(8) unsigned long long full[16], empty[16];
    const u32 box = (u32)box_rows * 128u, stage_bytes = box * (u32)copies;
    const u32 ring0 = ((u32)__cvta_generic_to_shared(ring) + 1023u) & ~1023u;
    const int rank = cluster_rank();
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbar_init((u32)__cvta_generic_to_shared(&full[s]), 1);
            mbar_init((u32)__cvta_generic_to_shared(&empty[s]), 2);
        }
        mbar_fence_init_cluster();
    }
    __syncthreads();
    cluster_sync();  // the other block's barriers exist before any copy multicast into it
    if (threadIdx.x == 0) {
        Cursor at;  // pair p = blockIdx.x / 2 takes boxes p, p + pairs, ...
        at.start((int)blockIdx.x / 2, (int)gridDim.x / 2, boxes, col_boxes);
        int s = 0;
        u32 parity = 0;
        for (int i = 0; i < iters; ++i) {
            const u32 full_s = (u32)__cvta_generic_to_shared(&full[s]);
            const u32 empty_s = (u32)__cvta_generic_to_shared(&empty[s]);
            if (i >= stages) {
                wait_stage(full_s, parity ^ 1u);  // this block holds the stage's last round
                mbar_arrive(empty_s);
                asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr(empty_s, rank ^ 1))
                             : "memory");
                wait_stage(empty_s, parity ^ 1u);  // and so does the other
            }
            mbar_arrive_expect_tx(full_s, stage_bytes);
            const u32 dst = ring0 + (u32)s * stage_bytes;
            for (int j = 0; j < copies; ++j) {
                if (j % 2 == rank)
                    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                                 ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;"
                                 ::"r"(dst + (u32)j * box), "l"(reinterpret_cast<unsigned long long>(&map2)),
                                   "r"(full_s), "r"(at.kc * 64), "r"(at.kr * box_rows), "h"((unsigned short)3)
                                 : "memory");
                at.step();
            }
            if (++s == stages) { s = 0; parity ^= 1u; }
        }
        for (int i = iters > stages ? iters - stages : 0; i < iters; ++i)
            wait_stage((u32)__cvta_generic_to_shared(&full[i % stages]), (u32)((i / stages) & 1));
    }
    __syncthreads();
    cluster_sync();  // no block exits while the other still multicasts into it or arrives on its barriers
}
"""


def slices_tensor_map(ptr: int, rows: int, cols: int, box_rows: int, depth: int):
    """A 3-D map of the row-major bf16 [rows, cols] matrix at ptr as (64 columns, rows, cols / 64 slices): a box
    of (64, box_rows, depth) lands as `depth` swizzled [box_rows][64] tiles one after the other, the layout of
    `depth` consecutive k-steps of a GEMM's W tile."""
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    tmap = call(driver.cuTensorMapEncodeTiled,
                driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, ptr,
                [u64(64), u64(rows), u64(cols // 64)],
                [u64(cols * 2), u64(128)],           # byte strides of the rows and of the 64-column slices
                [u32(64), u32(box_rows), u32(depth)],
                [u32(1), u32(1), u32(1)],
                driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
                detail=f"3-D tensor map of bf16 [{rows}, {cols}], box {box_rows} x 64 x {depth}")
    return TensorMap.from_buffer_copy(ctypes.string_at(tmap.getPtr(), 128))


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


def plan(paths, data, sms, box_rows, stages, max_sms: int, depths=(1,), copies=(1,), issuers=("one",)) -> list[dict]:
    """Every configuration, in the order run; left out: rings over MAX_RING, more SMs than the GPU has, slices
    (depth > 1) outside the tensor path, lanes issuing outside tensor and bulk (all cp_async's threads copy), and
    tensor_mc but with an even number of copies and of SMs (2-block clusters, each issuing half a stage)."""
    return [dict(path=p, data=d, sms=n, box_rows=r, depth=k, copies=c, issuer=i, stages=s)
            for p in paths for d in data for n in sms for r in box_rows for k in depths for c in copies
            for i in issuers for s in stages
            if s * c * k * r * 128 <= MAX_RING and n <= max_sms and (k == 1 or p == "tensor")
            and (i == "one" or p in ("tensor", "bulk")) and (p != "tensor_mc" or (c % 2 == 0 and n % 2 == 0))]


def render(rows: list[dict], run: str) -> str:
    lines = [f"Run: {run}. Bytes an SM pulls into shared memory, nothing computed (scripts/bench_ingest.py)", "",
             "| path | data | SMs | box KB | copies a stage | issued by | stages | in flight an SM, KB | GB/s | "
             "GB/s an SM | ns a copy an SM | us a launch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        box = r["box_rows"] * 128 * r["depth"]
        shape = f"{box / 1024:g}" + (f" ({r['depth']} slices)" if r["depth"] > 1 else "")
        per_sm = r["GB_s"] / r["sms"]
        lines.append(f"| {r['path']} | {r['data']} | {r['sms']} | {shape} | {r['copies']} | {r['issuer']} | "
                     f"{r['stages']} | {r['stages'] * r['copies'] * box / 1024:g} | {r['GB_s']:,.0f} | "
                     f"{per_sm:.1f} | {box / per_sm:.0f} | {r['us']:.1f} |")
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
    ap.add_argument("--stages", type=ints, default=[1, 2, 4, 6], help="stages in flight an SM (at most 16)")
    ap.add_argument("--depth", type=ints, default=[1], help="64-column slices a tensor box (3-D copies where > 1)")
    ap.add_argument("--copies", type=ints, default=[1], help="boxes a stage (at most 32)")
    ap.add_argument("--issuers", type=names(("one", "lanes")), default=["one"],
                    help="one: thread 0 issues a stage's copies; lanes: lane j of warp 0 issues copy j")
    ap.add_argument("--cols", type=int, default=2560, help="columns of the tensor path's matrix (its row length)")
    ap.add_argument("--l2-mb", type=int, default=16, help="data read again and again (smaller than the L2)")
    ap.add_argument("--hbm-mb", type=int, default=4096, help="data read once a launch (far larger than the L2)")
    ap.add_argument("--mb-per-sm", type=int, default=64, help="megabytes each block pulls a launch")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    return ap


def main() -> None:
    args = parser().parse_args()
    if (max(args.stages) > 16 or min(args.stages) < 1 or any(r % 8 or r > 256 for r in args.box_rows)
            or any(c < 1 or c > 32 for c in args.copies) or any(args.cols % (64 * d) or d > 256 for d in args.depth)):
        raise SystemExit("bench_ingest: --stages must be 1..16, --copies 1..32, --box-rows multiples of 8 up to 256 "
                         "(a box of whole 1,024-byte swizzle atoms) and --cols a multiple of 64 x each --depth")
    dev = get_device()
    run = run_header(f"{dev.info.name}, {dev.info.num_sms} SMs")
    print(f"Run: {run}", flush=True)
    module = _Cubin(compile_probe(device_arch()))
    kernel, kernel_mc = Kernel(module, "ingest"), Kernel(module, "ingest_mc")
    stream = Stream()
    buffers = {d: DeviceArray.zeros((mb << 20,), np.uint8, stream)
               for d, mb in (("l2", args.l2_mb), ("hbm", args.hbm_mb)) if d in args.data}
    rows = []
    for c in plan(args.paths, args.data, args.sms, args.box_rows, args.stages, dev.info.num_sms, args.depth,
                  args.copies, args.issuers):
        data, box = buffers[c["data"]], c["box_rows"] * 128 * c["depth"]
        mat_rows = data.nbytes // (args.cols * 2) // c["box_rows"] * c["box_rows"]  # whole boxes of rows
        col_boxes = args.cols // (64 * c["depth"])
        tensor = c["path"] in ("tensor", "tensor_mc")
        boxes = mat_rows // c["box_rows"] * col_boxes if tensor else data.nbytes // box
        map2 = bf16_tensor_map(data.ptr, mat_rows, args.cols, c["box_rows"])
        map3 = slices_tensor_map(data.ptr, mat_rows, args.cols, c["box_rows"], c["depth"]) if c["depth"] > 1 else map2
        iters = max(c["stages"], (args.mb_per_sm << 20) // (box * c["copies"]))  # stages filled a launch
        smem = max(c["stages"] * c["copies"] * box, ONE_BLOCK_SMEM) + 1024  # the ring's alignment
        if c["path"] == "tensor_mc":
            probe, launch_args = kernel_mc, [map2, I32(c["box_rows"]), I32(col_boxes), I32(boxes), I32(c["copies"]),
                                             I32(c["stages"]), I32(iters)]
        else:
            probe, launch_args = kernel, [map2, map3, data, I32(PATHS.index(c["path"])), I32(c["box_rows"]),
                                          I32(c["depth"]), I32(col_boxes), I32(boxes), I32(c["copies"]),
                                          I32(c["issuer"] == "lanes"), I32(c["stages"]), I32(iters)]
        probe.launch((c["sms"],), (THREADS,), launch_args, stream, smem)  # untimed
        start, end = Event(), Event()
        start.record(stream)
        for _ in range(args.launches):
            probe.launch((c["sms"],), (THREADS,), launch_args, stream, smem)
        end.record(stream)
        end.synchronize()
        us = start.elapsed_ms(end) * 1e3 / args.launches
        rows.append(dict(c, box_bytes=box, iters=iters, us=us, GB_s=c["sms"] * iters * c["copies"] * box / us / 1e3))
        print(f"{c}: {rows[-1]['GB_s']:,.0f} GB/s ({rows[-1]['GB_s'] / c['sms']:.1f} an SM)", flush=True)
    text = render(rows, run)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_ingest.json").write_text(json.dumps(dict(run=run, rows=rows), indent=1))
    (args.out / "bench_ingest.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
