#!/usr/bin/env python3
"""What each kernel adds to a decode step's critical path, from an Nsight Systems trace of a run.

Under programmatic dependent launch a kernel's grid starts before the kernel ahead of it ends (its blocks wait
in pdl_start), so kernel durations overlap and do not add up to the step. This script walks each decode step's
kernels in launch order and charges each the time it adds to the step: its end minus the later of its start and
the end of the kernels before it. Those charges add up to the step's time on the GPU (less any idle gap between
kernels); per kernel name they say where the step goes, and per position in a layer where a layer goes.

Record on the GPU machine (the trace of a batch-1 decode; nsys's sqlite export, with the CUDA graphs traced
node by node):

    nsys profile --cuda-graph-trace=node --trace=cuda --sample=none --cpuctxsw=none -o run \\
        python3 scripts/bench.py --models qwen3-4b --context 32768 --new 24 --repeats 1 --prefill '' --kv bf16
    nsys export --type sqlite -o run.sqlite run.nsys-rep

then, on any machine:

    python3 scripts/step_chain.py run.sqlite [--steps 20] [--step-start fetch_step] [--layer-kernels 7]

It prints the step's median time, a table of kernel names (launches a step, microseconds a step on the critical
path, microseconds a launch) and, with --layer-kernels K (the kernels of one transformer layer), the median charge
at each of a layer's K positions over the middle layers. A step is the kernels from one --step-start launch (the
decode graph's first kernel: runner/gpu.py's fetch_step) up to the next; the last --steps whole steps count.
"""
from __future__ import annotations

import argparse
import sqlite3
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Kernel:
    start: int  # ns
    end: int    # ns
    name: str
    grid: tuple[int, int, int]


def read_kernels(path: Path) -> list[Kernel]:
    """Every kernel launch in an nsys sqlite export, by start time."""
    with sqlite3.connect(path) as db:
        names = dict(db.execute("SELECT id, value FROM StringIds"))
        rows = db.execute("SELECT start, end, shortName, gridX, gridY, gridZ FROM CUPTI_ACTIVITY_KIND_KERNEL "
                          "ORDER BY start").fetchall()
    return [Kernel(s, e, names[n], (gx, gy, gz)) for s, e, n, gx, gy, gz in rows]


def decode_steps(kernels: list[Kernel], step_start: str, steps: int) -> list[list[Kernel]]:
    """The last `steps` whole steps: each from a `step_start` launch up to (not including) the next one."""
    starts = [i for i, k in enumerate(kernels) if k.name == step_start]
    if len(starts) < 2:
        raise SystemExit(f"step_chain: fewer than two {step_start!r} launches in the trace: no whole step to count")
    whole = list(zip(starts[:-1], starts[1:]))[-steps:]
    return [kernels[a:b] for a, b in whole]


def charges(step: list[Kernel]) -> list[float]:
    """Microseconds each kernel of a step adds to it: its end past the end of every kernel before it (0 when it
    ends earlier), counted from the later of its start and that end."""
    out, done = [], step[0].start
    for k in step:
        out.append(max(0, k.end - max(done, k.start)) / 1000)
        done = max(done, k.end)
    return out


def by_name(steps: list[list[Kernel]]) -> list[tuple[str, float, float]]:
    """(name, launches a step, microseconds a step on the critical path), the most first."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for step in steps:
        for k, c in zip(step, charges(step)):
            total[k.name] = total.get(k.name, 0.0) + c
            count[k.name] = count.get(k.name, 0) + 1
    n = len(steps)
    return sorted(((name, count[name] / n, total[name] / n) for name in total), key=lambda r: -r[2])


def by_layer_position(steps: list[list[Kernel]], layer_kernels: int) -> list[tuple[str, float]]:
    """(name, median microseconds) at each of a layer's positions, over the steps' middle layers: the layers
    are the step's kernels after its first (the step's start), `layer_kernels` at a time; the first and last
    layers (next to the step's start and the LM head) are left out."""
    per_pos: list[list[float]] = [[] for _ in range(layer_kernels)]
    names: list[str] = [""] * layer_kernels
    for step in steps:
        c = charges(step)
        layers = (len(step) - 1) // layer_kernels
        for layer in range(1, layers - 1):
            for p in range(layer_kernels):
                i = 1 + layer * layer_kernels + p
                per_pos[p].append(c[i])
                names[p] = step[i].name
    return [(names[p], statistics.median(v)) for p, v in enumerate(per_pos) if v]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="nsys export --type sqlite of the run")
    ap.add_argument("--steps", type=int, default=20, help="the last N whole decode steps count")
    ap.add_argument("--step-start", default="fetch_step", help="the kernel that begins each decode step")
    ap.add_argument("--layer-kernels", type=int, default=0, help="kernels a layer: also the charges by position")
    args = ap.parse_args()
    steps = decode_steps(read_kernels(args.trace), args.step_start, args.steps)
    times = [(s[-1].end - s[0].start) / 1000 for s in steps]
    print(f"{len(steps)} steps of {len(steps[-1])} kernels: median {statistics.median(times):.1f} us from the first "
          f"kernel's start to the last one's end")
    print("\n| kernel | launches a step | us a step on the critical path | us a launch |\n|---|---|---|---|")
    for name, launches, us in by_name(steps):
        print(f"| {name} | {launches:g} | {us:.1f} | {us / launches:.2f} |")
    if args.layer_kernels:
        print("\n| position in a layer | kernel | median us on the critical path |\n|---|---|---|")
        for p, (name, us) in enumerate(by_layer_position(steps, args.layer_kernels)):
            print(f"| {p} | {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
