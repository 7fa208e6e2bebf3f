"""How fast this machine compiles the kernels, round after round, against the seconds since it started.

    python3 scripts/compile_timeline.py [--seconds 120] [--salt] [--files rmsnorm.cu,embedding.cu]

Each round compiles every unit of cuda_src/ (or of --files) with compile_all, a child process a unit and as many at
once as there are cores, as a cold start does, into an empty kernel cache of its own, and prints the machine's
uptime (/proc/uptime), the CPU time the hypervisor took from it meanwhile (steal, /proc/stat) and the compiler's
line (tileinfer/cuda/compiler.py COMPILE_LOG: the wall seconds, the children's seconds summed, their CPU seconds and
page faults, NVRTC's share). Rounds start until --seconds have passed (at least one). A fresh machine's first
process compiles in the first round's conditions: run this as a machine start's first command to see how long
those last.

--salt compiles a copy of cuda_src/ whose common.cuh (which every unit includes) declares one more unused variable,
named anew each round, so that no cache of compiled code on the machine can have seen the sources.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tileinfer.cuda import compiler  # noqa: E402
from tileinfer.cuda.compiler import compile_all, cuda_src_dir, kernel_files, part_defines  # noqa: E402


def uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def steal_ticks() -> int:
    """The CPU time stolen from this machine by its hypervisor so far, in clock ticks (/proc/stat's 8th field)."""
    return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8])


class CompilerLine(logging.Handler):
    """Keeps the last COMPILE_LOG line compile_all logs."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.line = None

    def emit(self, record):
        if record.msg == compiler.COMPILE_LOG:
            self.line = record.getMessage()


def one_round(files: list[str], src: Path, work: Path, salt: int | None) -> str:
    """Compile the units of `files` of `src` into an empty kernel cache under `work` (a copy of `src` salted with
    `salt` when given, above); the line to print."""
    if salt is not None:
        shutil.copytree(src, work / "src")
        header = work / "src" / "common.cuh"
        header.write_text(header.read_text() + f"\n__device__ int tileinfer_compile_timeline_salt_{salt};\n")
        src = work / "src"
    os.environ["TILEINFER_CUDA_SRC"] = str(src)
    os.environ["TILEINFER_CACHE"] = str(work / "cache")
    compiler._memory_cache.clear()  # as in a new process: every compile this round asks for happens
    handler, level = CompilerLine(), compiler.log.level
    compiler.log.addHandler(handler)
    compiler.log.setLevel(logging.INFO)
    up, stolen = uptime(), steal_ticks()
    try:
        compile_all([(f, d) for f in files for d in part_defines(f)], arch="sm_90a")
    finally:
        compiler.log.removeHandler(handler)
        compiler.log.setLevel(level)
    return (f"uptime {up:.1f} s, steal {(steal_ticks() - stolen) / os.sysconf('SC_CLK_TCK'):.2f} s: "
            f"{handler.line or 'nothing compiled'}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120.0, help="start rounds until this many seconds have passed")
    ap.add_argument("--salt", action="store_true", help="sources no compile on this machine has seen (above)")
    ap.add_argument("--files", default=None, help="comma-separated cuda_src files (default: every kernel file)")
    args = ap.parse_args(argv)
    src = cuda_src_dir()
    files = args.files.split(",") if args.files else kernel_files()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compile-timeline-") as work:
        n = 0
        while n == 0 or time.perf_counter() - start < args.seconds:
            (Path(work) / str(n)).mkdir()
            print(one_round(files, src, Path(work) / str(n), n if args.salt else None), flush=True)
            n += 1


if __name__ == "__main__":
    main()
