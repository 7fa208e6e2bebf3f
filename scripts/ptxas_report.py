#!/usr/bin/env python3
"""What the assembler says about the kernels of cuda_src/, on any machine (NVRTC alone, no GPU): per entry point its
registers, stack frame, spills and shared memory, and the assembler's performance notes, e.g. C7515 ("wgmma.mma_async
instructions are serialized ...": a tensor-core kernel whose wgmmas wait for one another).

    python3 scripts/ptxas_report.py [--files gemm_tma.cu,gemv.cu] [--arch sm_90a] [--all]

Each file (each part of a file compiled in parts) is compiled once, uncached, with the options the runtime uses
(tileinfer/cuda/compiler.py) and --ptxas-options=-v. Prints a table of the entry points with a spill, a stack frame
or a performance note (every entry point with --all) and a summary line. The figures are the assembler's, not a
measurement: a stack frame or a note says where to look, and the GPU says what it costs. They are those of this
machine's NVRTC, whose assembler may differ from the GPU machine's.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's package, when not installed
from tileinfer.cuda.compiler import assembler_log, kernel_files, nvrtc_version, part_defines  # noqa: E402

_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_NOTE = re.compile(r"ptxas (?:info|warning)\s*: \((C\d+)\) (.*?)(?: in the function '(\w+)')?(?: in line \d+)?$")


@dataclass
class Entry:
    file: str
    name: str
    registers: int = 0
    smem: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def notable(self) -> bool:
        return bool(self.stack or self.spill_stores or self.spill_loads or self.notes)


def parse_log(file: str, log: str) -> list[Entry]:
    """The entry points of one compile's verbose log, in the order the assembler took them. A performance note
    goes to the function it names, else to the entry point being compiled."""
    entries: dict[str, Entry] = {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = entries.setdefault(m.group(1), Entry(file, m.group(1)))
        elif (m := _FRAME.search(line)) and current is not None:
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif (m := _USED.search(line)) and current is not None:
            current.registers = int(m.group(1))
            current.smem = int(m.group(2) or 0)
        elif m := _NOTE.search(line.strip()):
            code, text, function = m.groups()
            target = entries.setdefault(function, Entry(file, function)) if function else current
            if target is not None and f"{code}: {text}" not in target.notes:
                target.notes.append(f"{code}: {text}")
    return list(entries.values())


def report(files: list[str], arch: str) -> list[Entry]:
    entries = []
    for file in files:
        for defines in part_defines(file):
            entries += parse_log(file, assembler_log(file, arch, defines))
            part = "" if defines is None else f" part {defines['KERNEL_PART']}"
            print(f"  {file}{part}: compiled", file=sys.stderr, flush=True)
    return entries


def render(entries: list[Entry], everything: bool) -> str:
    rows = [e for e in entries if everything or e.notable]
    lines = ["| file | entry point | registers | stack bytes | spill stores / loads | static smem bytes | notes |",
             "|---|---|---|---|---|---|---|"]
    for e in sorted(rows, key=lambda e: (e.file, e.name)):
        lines.append(f"| {e.file} | {e.name} | {e.registers} | {e.stack} | {e.spill_stores} / {e.spill_loads} | "
                     f"{e.smem} | {'; '.join(e.notes) or '-'} |")
    spills = sum(1 for e in entries if e.spill_stores or e.spill_loads)
    stacks = sum(1 for e in entries if e.stack)
    noted = sum(1 for e in entries if e.notes)
    major, minor = nvrtc_version()
    lines += ["", f"{len(entries)} entry points (NVRTC {major}.{minor}): {spills} with spills, {stacks} with a stack "
                  f"frame, {noted} with a performance note"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default=None, help="cuda_src files, comma-separated (default: every kernel file)")
    p.add_argument("--arch", default="sm_90a", help="the architecture compiled for (sm_90a: the wgmma builds)")
    p.add_argument("--all", action="store_true", help="every entry point, not only those with something to see")
    args = p.parse_args(argv)
    files = args.files.split(",") if args.files else kernel_files()
    unknown = sorted(set(files) - set(kernel_files()))
    if unknown:
        p.error(f"no such kernel file in cuda_src/: {', '.join(unknown)} (there are {', '.join(kernel_files())})")
    print(render(report(files, args.arch), args.all))
    return 0


if __name__ == "__main__":
    sys.exit(main())
