#!/usr/bin/env python3
"""Which kernels' machine code a change to cuda_src/ changes, on any machine (NVRTC alone, no GPU).

    python3 scripts/sass_diff.py BASE [--files gemm_swap.cu,gemm_tma.cu] [--arch sm_90a] [--timings]

Compiles each file (every part of a file compiled in parts) from the git revision BASE and from the working
tree, with the options the package compiles with, and compares each entry point's SASS (its .text section in
the cubin). A change meant to leave some kernels alone (a comment, a build added beside the others, code
shared between builds) shows here whether it did: the kernels of the same bytes run as before, and only those
listed as changed need the GPU's tests and timings. A kernel's code can change with its neighbours in a compile
unit: a function-local `static __shared__` variable is declared in the kernel where it alone uses it, else in the
module, and the assembler lays out the kernel differently (gemm_swap.cu's parts_bar, when builds beside the split
ones were removed). The cubins come from the package's kernel cache where it has them. Prints a line a changed,
added or removed entry point, then a count of each. --timings: every unit compiled afresh (an empty cache), one
at a time, and each file's NVRTC seconds and cubin bytes, summed over its units, for both trees (what a change
costs a cold start's compiles).
"""
from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's package, when not installed
from tileinfer.cuda.compiler import compile_source, cuda_src_dir, part_defines  # noqa: E402


def text_sections(cubin: bytes) -> dict[str, bytes]:
    """Each kernel's machine code in a cubin: the ELF sections .text.<entry point>."""
    if cubin[:6] != b"\x7fELF\x02\x01":
        raise ValueError(f"not a 64-bit little-endian ELF image (a cubin): it starts {cubin[:8]!r}")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name_off, kind, _, _, offset, size, *_ in headers:
        name = cubin[names_at + name_off:cubin.index(b"\0", names_at + name_off)].decode()
        if name.startswith(".text.") and kind != 8:  # (SHT_NOBITS has no bytes)
            out[name[len(".text."):]] = cubin[offset:offset + size]
    return out


def _compile(src_dir: str, filename: str, defines, arch: str) -> tuple[bytes, float]:
    """The unit's cubin and the seconds its compile (or its cache's read) took."""
    source = (Path(src_dir) / filename).read_text()
    start = time.perf_counter()
    cubin = compile_source(filename, source, arch, defines, Path(src_dir))
    return cubin, time.perf_counter() - start


def units(src_dir: Path, files: list[str], arch: str, pool) -> dict[tuple[str, int], tuple[bytes, float]]:
    """(file, part) -> (cubin, seconds) for `files` of src_dir, every part compiled."""
    jobs = {(f, i): pool.submit(_compile, str(src_dir), f, d, arch)
            for f in files if (src_dir / f).is_file() for i, d in enumerate(part_defines(f, src_dir))}
    return {key: job.result() for key, job in jobs.items()}


def sections(compiled: dict[tuple[str, int], tuple[bytes, float]]) -> dict[tuple[str, str], bytes]:
    """(file, entry point) -> SASS of units' cubins."""
    return {(f, name): text for (f, _), (cubin, _) in compiled.items() for name, text in text_sections(cubin).items()}


def kernels(src_dir: Path, files: list[str], arch: str, pool) -> dict[tuple[str, str], bytes]:
    """(file, entry point) -> SASS for `files` of src_dir, every part compiled."""
    return sections(units(src_dir, files, arch, pool))


def costs(compiled: dict[tuple[str, int], tuple[bytes, float]]) -> dict[str, tuple[int, float, int]]:
    """file -> (units, NVRTC seconds summed, cubin bytes summed)."""
    out: dict[str, tuple[int, float, int]] = {}
    for (f, _), (cubin, seconds) in compiled.items():
        n, t, b = out.get(f, (0, 0.0, 0))
        out[f] = (n + 1, t + seconds, b + len(cubin))
    return out


def compare(base: dict, tree: dict) -> dict[str, list[tuple[str, str]]]:
    """The entry points that changed, were added, were removed and kept their bytes, each sorted."""
    return {"changed": sorted(k for k in base.keys() & tree.keys() if base[k] != tree[k]),
            "added": sorted(tree.keys() - base.keys()), "removed": sorted(base.keys() - tree.keys()),
            "same": sorted(k for k in base.keys() & tree.keys() if base[k] == tree[k])}


def checkout_sources(revision: str, into: Path) -> None:
    """cuda_src/ of a git revision, its files written into `into`."""
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:cuda_src"], check=True,
                             capture_output=True, text=True).stdout.split()
    for name in listing:
        text = subprocess.run(["git", "show", f"{revision}:cuda_src/{name}"], check=True, capture_output=True).stdout
        (into / name).write_bytes(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the git revision to compare the working tree's cuda_src/ with")
    p.add_argument("--files", default="", help="kernel files, comma-separated (default: every one)")
    p.add_argument("--arch", default="sm_90a", help="the architecture compiled for (sm_90a: the wgmma builds)")
    p.add_argument("--timings", action="store_true",
                   help="compile every unit afresh, one at a time, and print each file's NVRTC seconds and bytes")
    args = p.parse_args(argv)
    here = cuda_src_dir()
    files = [f for f in args.files.split(",") if f] or sorted(q.name for q in here.glob("*.cu"))
    with tempfile.TemporaryDirectory() as tmp:
        base_dir, cache = Path(tmp) / "base", Path(tmp) / "cache"
        base_dir.mkdir()
        try:
            checkout_sources(args.base, base_dir)
        except subprocess.CalledProcessError as e:
            print(f"sass_diff: no cuda_src/ at {args.base!r} in this git checkout ({e.stderr.strip()})",
                  file=sys.stderr)
            return 2
        saved = os.environ.get("TILEINFER_CACHE")
        if args.timings:  # (the pool's worker, started below, inherits it)
            os.environ["TILEINFER_CACHE"] = str(cache)
        try:
            with ProcessPoolExecutor(1 if args.timings else None) as pool:
                base, tree = units(base_dir, files, args.arch, pool), units(here, files, args.arch, pool)
        finally:
            if saved is None:
                os.environ.pop("TILEINFER_CACHE", None)
            else:
                os.environ["TILEINFER_CACHE"] = saved
    result = compare(sections(base), sections(tree))
    for kind in ("changed", "added", "removed"):
        for f, name in result[kind]:
            print(f"{kind:8s} {f}: {name}")
    if args.timings:
        before, after = costs(base), costs(tree)
        for f in sorted(before.keys() | after.keys()):
            (n0, t0, b0), (n1, t1, b1) = before.get(f, (0, 0.0, 0)), after.get(f, (0, 0.0, 0))
            print(f"compiles {f}: {n0} units, {t0:.2f} s, {b0:,} bytes at {args.base}; {n1} units, {t1:.2f} s, "
                  f"{b1:,} bytes in the working tree")
    print(", ".join(f"{len(result[k])} {k}" for k in ("same", "changed", "added", "removed")) +
          f" ({args.arch}, against {args.base})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
