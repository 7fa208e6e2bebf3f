"""Time every compile unit of cuda_src/ and write the table compile_all orders its units by.

    python3 scripts/compile_seconds.py [--repeats 2] [--cores 16] [--dry-run]

Each unit (a file, or one part of a file that says `#define KERNEL_PARTS n`) is compiled for sm_90a in a child
process of its own (tileinfer/cuda/nvrtc_child.py, as compile_all does), one at a time, into an empty temporary
kernel cache; its time is the median of --repeats runs. The table goes to tileinfer/cuda/compile_seconds.py (not
with --dry-run). Also printed: how long compile_all would take on --cores cores with these times, in the order the
table gives (the longest first) and in the order of the units' source sizes, each unit starting on the first core
free. Run it when a .cu file gains or loses parts (tests/test_compile_all.py checks that the table names every
unit) or when a file's compile time changes much.
"""
from __future__ import annotations

import argparse
import heapq
import os
import statistics
import sys
import tempfile
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "tileinfer" / "cuda" / "compile_seconds.py"


def makespan(seconds: list[float], cores: int) -> float:
    """The time `cores` workers take over units of these durations, each started in turn on the first free one."""
    free = [0.0] * cores
    for s in seconds:
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free)


def render(table: dict[str, float], sum_seconds: float) -> str:
    rows = "\n".join(f'    "{key}": {s:.2f},' for key, s in table.items())
    return f'''"""Seconds each compile unit of cuda_src/ took (NVRTC, for sm_90a, one unit at a time in a process of
its own, {sum_seconds:.0f} s in all on the 2-core development machine), by unit: "file.cu", or "file.cu:p" for part
p of a file that says `#define KERNEL_PARTS n`. compiler.compile_all starts the longest units first, so that a long
one does not start last and keep every other core waiting for it. Written by scripts/compile_seconds.py."""
SECONDS = {{
{rows}
}}
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1, help="compiles of each unit; its time is their median")
    ap.add_argument("--cores", type=int, default=16, help="cores of the printed estimate of compile_all's time")
    ap.add_argument("--dry-run", action="store_true", help="print the times; leave the table as it is")
    args = ap.parse_args()
    os.environ["TILEINFER_CACHE"] = tempfile.mkdtemp(prefix="compile-seconds-")
    from tileinfer.cuda import compiler

    src = compiler.cuda_src_dir()
    table, sizes = {}, {}
    for name in compiler.kernel_files():
        for defines in compiler.part_defines(name):
            unit = compiler._unit(name, (src / name).read_text(), "sm_90a", defines, src)
            runs = [compiler._compile_in_child(unit)[1].seconds for _ in range(args.repeats)]
            key = compiler.unit_key(unit)
            table[key] = statistics.median(runs)
            sizes[key] = len(unit.source) + sum(map(len, unit.headers.values()))
            print(f"{table[key]:6.2f} s  {key}", flush=True)
    total = sum(table.values())
    longest = sorted(table.values(), reverse=True)
    by_size = [table[k] for k in sorted(table, key=lambda k: (":" in k, sizes[k]), reverse=True)]
    print(f"{total:.1f} s in all; on {args.cores} cores {makespan(longest, args.cores):.2f} s the longest first, "
          f"{makespan(by_size, args.cores):.2f} s by source size (parts first)")
    if not args.dry_run:
        TABLE.write_text(render(table, total))
        print(f"wrote {TABLE}", file=sys.stderr)


if __name__ == "__main__":
    main()
