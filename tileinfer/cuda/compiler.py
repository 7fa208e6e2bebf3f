"""NVRTC compilation of `cuda_src/*.cu` to cubin, with a content-addressed on-disk cache.

The cache key hashes everything that can change the binary: the source, every header it
includes (recursively, our own `#include "x.cuh"` files), the options, the target arch and
the NVRTC version. Files are written atomically (temp file + rename), so concurrent
processes never read half a cubin. Within a process each key is compiled at most once: a unit that a compile_all
on another thread has under way is waited for, not compiled again.

`compile_all` compiles what the caches lack, every unit in a child process of its own (nvrtc_child.py),
as many at once as there are cores, the longest first (compile_seconds.py); with everything cached it starts
none. A unit is a file, or one part of a file that says `#define KERNEL_PARTS n` (compiled n times with
-DKERNEL_PART=p, each part holding some of its entry points: cuda_src/common.cuh's IN_PART), so that no single
compile is long.
Processes, not threads: they compile in parallel whatever NVRTC serialises inside one process (the
GIL, locks of its own). Plain child processes, not multiprocessing: its spawned children import the
parent's __main__ again (a user's script without a main guard would run again in each), and each would
import the whole package (seconds) to compile.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from cuda.bindings import nvrtc

from .compile_seconds import SECONDS as UNIT_SECONDS
from .driver import call

log = logging.getLogger(__name__)

CUDA_SRC = Path(__file__).resolve().parent.parent.parent / "cuda_src"
BASE_OPTIONS = ("-std=c++17", "-default-device", "-lineinfo", "-DNDEBUG")

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_PARTS = re.compile(r"^\s*#\s*define\s+KERNEL_PARTS\s+(\d+)\b", re.MULTILINE)
CHILD = Path(__file__).resolve().with_name("nvrtc_child.py")  # compile_all's child process
COMPILE_FAILED = 3  # its exit status when NVRTC rejects the source (its output is then NVRTC's log)
# What a child reports on its stderr: NVRTC's seconds, then its own CPU seconds (user, system) and page faults
# (minor: a page mapped without a read from disk; major: read from disk), from getrusage at its end.
CHILD_REPORT = re.compile(rb"^nvrtc_seconds ([0-9.]+) user ([0-9.]+) system ([0-9.]+) faults (\d+) (\d+)$",
                          re.MULTILINE)
# compile_all's line once it compiled anything: where a cold start's compile time went. A child's time beyond
# NVRTC's compile is its interpreter's start, its imports and libnvrtc's load, where a fresh machine's first reads
# of them would show (as major faults); the system seconds are the kernel's work for the children, their page
# faults' among it, and the user seconds NVRTC's own work and the interpreter's.
COMPILE_LOG = ("compiled %d kernel units in %.2f s on %d cores: their processes took %.1f s summed (CPU %.1f s user, "
               "%.1f s system; %.0f thousand page faults, %.0f from disk), NVRTC %.1f s of it; the longest %s (%.2f s)")


class ChildTimes(NamedTuple):
    """One compile's child process: its wall seconds, NVRTC's compile's of them, its CPU seconds and page faults
    (CHILD_REPORT; NaN where it reported none)."""
    seconds: float
    nvrtc: float = math.nan
    user: float = math.nan
    system: float = math.nan
    minor_faults: float = math.nan
    major_faults: float = math.nan


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source. Carries the log, the options and the numbered source."""

    def __init__(self, name: str, log_text: str, options: list[str], source: str):
        self.name, self.log, self.options, self.source = name, log_text, options, source
        numbered = "\n".join(f"{i:4d} | {line}" for i, line in enumerate(source.splitlines(), 1))
        super().__init__(f"NVRTC failed to compile {name} with options {' '.join(options)}:\n"
                         f"{log_text}\n--- source ---\n{numbered}")


@dataclass
class CompileStats:
    compiled: int = 0       # NVRTC invocations
    disk_hits: int = 0      # loaded from the on-disk cache
    memory_hits: int = 0    # already compiled in this process
    waits: int = 0          # taken from a compile_all under way on another thread, once it ended
    seconds: float = 0.0    # time the compiles took, summed (a child's: from its start to its end)


STATS = CompileStats()
_memory_cache: dict[str, bytes] = {}
_in_flight: dict[str, Future] = {}  # key -> compile_all's compile of it, from its start until its cubin is stored


def cuda_src_dir() -> Path:
    override = os.environ.get("TILEINFER_CUDA_SRC")
    if override:
        return Path(override)
    if CUDA_SRC.is_dir():
        return CUDA_SRC
    from .. import cuda_src  # installed as a package (wheel install)
    return Path(cuda_src.__file__).parent


def cache_dir() -> Path:
    root = os.environ.get("TILEINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tileinfer")
    path = Path(root) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def nvrtc_version() -> tuple[int, int]:
    return call(nvrtc.nvrtcVersion)


def read_headers(source: str, src_dir: Path) -> dict[str, str]:
    """Every quoted #include reachable from `source`, name -> text (recursively)."""
    headers: dict[str, str] = {}
    pending = _INCLUDE.findall(source)
    while pending:
        name = pending.pop()
        if name in headers:
            continue
        path = src_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{name} is included but not found in {src_dir}")
        headers[name] = path.read_text()
        pending.extend(_INCLUDE.findall(headers[name]))
    return headers


def cache_key(source: str, headers: dict[str, str], options: list[str], arch: str) -> str:
    h = hashlib.sha256()
    for part in (source, *(f"{k}\0{headers[k]}" for k in sorted(headers)), *options, arch,
                 "nvrtc %d.%d" % nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0\1")
    return h.hexdigest()


def compile_file(filename: str, arch: str, defines: dict[str, object] | None = None) -> bytes:
    """Compile `cuda_src/<filename>` for `arch` (e.g. 'sm_90'); returns the cubin bytes."""
    src_dir = cuda_src_dir()
    source = (src_dir / filename).read_text()
    return compile_source(filename, source, arch, defines, src_dir)


def compile_source(name: str, source: str, arch: str, defines: dict[str, object] | None = None,
                   src_dir: Path | None = None) -> bytes:
    unit = _unit(name, source, arch, defines, src_dir or cuda_src_dir())
    cubin = _cached(unit)
    if cubin is None:
        start = time.perf_counter()
        cubin = _nvrtc_compile(unit.name, unit.source, unit.headers, unit.options)[0]
        _store(unit, cubin, time.perf_counter() - start)
    return cubin


@dataclass(frozen=True, slots=True)
class _Unit:
    """One NVRTC compile: its inputs and where its cubin is cached."""
    name: str
    source: str
    headers: dict[str, str]
    options: list[str]
    key: str
    path: Path                    # the cubin in the disk cache


def _unit(name: str, source: str, arch: str, defines: dict[str, object] | None, src_dir: Path) -> _Unit:
    headers = read_headers(source, src_dir)
    options = compile_options(arch, defines)
    key = cache_key(source, headers, options, arch)
    return _Unit(name, source, headers, options, key, cache_dir() / f"{Path(name).stem}-{arch}-{key[:24]}.cubin")


def _cached(unit: _Unit) -> bytes | None:
    """The unit's cubin from the memory cache, else from the compile of it under way (once it ends; its
    CompileError is raised here), else the disk cache, else None."""
    if unit.key in _memory_cache:
        STATS.memory_hits += 1
        return _memory_cache[unit.key]
    compiling = _in_flight.get(unit.key)
    if compiling is not None:
        try:
            cubin = compiling.result()[0]
        except CancelledError:  # its compile_all stopped at another unit's error before starting it
            pass
        else:
            STATS.waits += 1
            return cubin
    if not unit.path.is_file():  # (a compile that ended stored its cubin before leaving _in_flight)
        return None
    cubin = unit.path.read_bytes()
    STATS.disk_hits += 1
    _memory_cache[unit.key] = cubin
    return cubin


def _store(unit: _Unit, cubin: bytes, seconds: float) -> None:
    """A freshly compiled cubin into both caches."""
    STATS.seconds += seconds
    STATS.compiled += 1
    _write_atomic(unit.path, cubin)
    _memory_cache[unit.key] = cubin
    log.debug("compiled %s (%s) in %.2f s", unit.name, " ".join(unit.options), seconds)


# ----------------------------------------------------------------------------- many at once
def kernel_files() -> list[str]:
    """Every kernel file of cuda_src/, by name."""
    return sorted(p.name for p in cuda_src_dir().glob("*.cu"))


def part_defines(filename: str, src_dir: Path | None = None) -> list[dict[str, object] | None]:
    """The defines of each compile of `cuda_src/<filename>` (or of src_dir's): [None] (the whole file), or one
    {"KERNEL_PART": p} a part when the file says `#define KERNEL_PARTS n`."""
    found = _PARTS.findall(((src_dir or cuda_src_dir()) / filename).read_text())
    if not found:
        return [None]
    if len(found) > 1 or int(found[0]) < 2:
        raise ValueError(f"{filename}: define KERNEL_PARTS once, as a number of parts >= 2 (found {found})")
    return [{"KERNEL_PART": p} for p in range(int(found[0]))]


def compile_all(units: list[tuple[str, dict[str, object] | None]], arch: str, progress: bool = False,
                first: Collection[str] = (), last: Collection[str] = ()) -> None:
    """Compile each (cuda_src file, defines) unit the caches lack into them, each in a child process of
    its own, as many at once as there are cores: the units named in `first` ("file.cu" or "file.cu:p", as
    unit_key names them), then the others, then those of the files in `last`, each group the longest first; with a
    progress bar naming what is left when asked: of the `first` units when there are any (what a first request waits
    for: the bar closes once they are done, before its output starts), else of every unit.
    With everything cached no process starts; a unit another compile_all has under way is left to it (_cached
    waits for it). A failed compile raises its CompileError."""
    src_dir = cuda_src_dir()
    todo = [unit for unit in (_unit(f, (src_dir / f).read_text(), arch, d, src_dir) for f, d in units)
            if unit.key not in _memory_cache and unit.key not in _in_flight and not unit.path.is_file()]
    if not todo:
        return

    def order(unit: _Unit) -> tuple[int, float]:  # in a group the longest first: none starts last, holding the rest up
        group = 0 if unit_key(unit) in first else 2 if unit.name in last else 1
        return group, -_expected_seconds(unit)
    todo.sort(key=order)
    shown = {unit.key for unit in todo if not first or unit_key(unit) in first} if progress else set()
    bar = None
    if shown:
        from tqdm import tqdm
        bar = tqdm(total=len(shown), unit="compile", desc="compiling kernels (once; then cached)", leave=False)
    cores = len(os.sched_getaffinity(0))  # the cores this process may run on
    start, times = time.perf_counter(), []  # (unit, ChildTimes)
    with ThreadPoolExecutor(max_workers=min(len(todo), cores)) as pool:
        pending = {pool.submit(_compile_in_child, unit): unit for unit in todo}
        _in_flight.update((unit.key, future) for future, unit in pending.items())
        try:
            while pending:
                if bar is not None:
                    bar.set_postfix_str(_left(u for u in pending.values() if u.key in shown), refresh=True)
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    unit = pending.pop(future)
                    try:
                        cubin, child = future.result()  # a child's CompileError is raised here
                        _store(unit, cubin, child.seconds)
                    finally:  # (stored first: another thread finds the cubin in one place or the other)
                        _in_flight.pop(unit.key, None)  # (two units of the same source share a key)
                    times.append((unit, child))
                    if bar is not None and unit.key in shown:
                        bar.update()
                        if bar.n == len(shown):
                            bar.close()
                            bar = None
        finally:
            for future, unit in pending.items():
                future.cancel()
                _in_flight.pop(unit.key, None)
            if bar is not None:
                bar.close()
    longest = max(times, key=lambda t: t[1].seconds)
    seconds, nvrtc, user, system, minor, major = map(sum, zip(*(child for _, child in times)))
    log.info(COMPILE_LOG, len(times), time.perf_counter() - start, cores, seconds, user, system,
             (minor + major) / 1e3, major, nvrtc, _label(longest[0]), longest[1].seconds)


def units_in_flight() -> int:
    """Units a compile_all has under way or queued (start_compiling's, while a short first request already runs)."""
    return len(_in_flight)


def _left(units) -> str:
    """What the progress bar says is left: each file, with its number of parts left when more than one."""
    counts: dict[str, int] = {}
    for unit in units:
        counts[unit.name] = counts.get(unit.name, 0) + 1
    return "left: " + ", ".join(name if n == 1 else f"{name} ({n} parts)" for name, n in counts.items())


def _part(unit: _Unit) -> str | None:
    """The part of its file a unit compiles, None for a whole file."""
    return next((o.split("=", 1)[1] for o in unit.options if o.startswith("-DKERNEL_PART=")), None)


def unit_key(unit: _Unit) -> str:
    """A unit as compile_seconds.SECONDS names it: "file.cu", or "file.cu:p" for part p."""
    return unit.name if _part(unit) is None else f"{unit.name}:{_part(unit)}"


def _expected_seconds(unit: _Unit) -> float:
    """How long `unit` takes to compile, as compile_seconds.SECONDS measured it; a unit it does not name (a part
    added since) counts as the longest, so that it starts among the first."""
    return UNIT_SECONDS.get(unit_key(unit), max(UNIT_SECONDS.values()))


def _label(unit: _Unit) -> str:
    """A unit as an error names it: the file, and its part when it has one."""
    return unit.name if _part(unit) is None else f"{unit.name} (part {_part(unit)})"


def _compile_in_child(unit: _Unit) -> tuple[bytes, ChildTimes]:
    """(cubin, what its process took) of one compile in a child process (nvrtc_child.py); CompileError
    with NVRTC's log when NVRTC rejects the source, RuntimeError with the child's own output when it fails
    otherwise."""
    job = json.dumps(dict(name=unit.name, source=unit.source, headers=unit.headers, options=unit.options))
    start = time.perf_counter()
    # -P: nothing on sys.path from the child's directory (tileinfer/cuda/ holds names like `module`)
    child = subprocess.run([sys.executable, "-P", str(CHILD)], input=job.encode(), capture_output=True)
    seconds = time.perf_counter() - start
    if child.returncode == 0:
        reported = CHILD_REPORT.search(child.stderr)
        return child.stdout, ChildTimes(seconds, *map(float, reported.groups())) if reported else ChildTimes(seconds)
    if child.returncode == COMPILE_FAILED:
        raise CompileError(unit.name, child.stdout.decode(errors="replace"), unit.options, unit.source)
    raise RuntimeError(f"the process compiling {_label(unit)} ({sys.executable} {CHILD}) failed with exit status "
                       f"{child.returncode}:\n{child.stderr.decode(errors='replace').strip()}")


def compile_options(arch: str, defines: dict[str, object] | None = None) -> list[str]:
    """NVRTC's options for `arch` (e.g. 'sm_90a') and the -D defines."""
    return [*BASE_OPTIONS, f"-arch={arch}", *(f"-D{k}={v}" for k, v in sorted((defines or {}).items()))]


def cubin_and_ptx(filename: str, arch: str) -> tuple[bytes, str]:
    """One uncached compile of `cuda_src/<filename>` for a real `arch`, with compile_file's options:
    the cubin and the PTX it was assembled from, to check what the compiler produced (e.g. the
    order of instructions in an entry point) without compiling twice."""
    src_dir = cuda_src_dir()
    source = (src_dir / filename).read_text()
    cubin, ptx, _ = _nvrtc_compile(filename, source, read_headers(source, src_dir), compile_options(arch), ptx=True)
    return cubin, ptx


def assembler_log(filename: str, arch: str, defines: dict[str, object] | None = None) -> str:
    """NVRTC's log of one uncached compile of `cuda_src/<filename>` (with `defines`: one part of a file compiled in
    parts) with compile_file's options and the assembler's verbose output (--ptxas-options=-v): per entry point its
    registers, stack frame, spills and shared memory, and the assembler's performance notes (scripts/ptxas_report.py
    reads it)."""
    src_dir = cuda_src_dir()
    source = (src_dir / filename).read_text()
    options = [*compile_options(arch, defines), "--ptxas-options=-v"]
    return _nvrtc_compile(filename, source, read_headers(source, src_dir), options)[2]


def _nvrtc_compile(name: str, source: str, headers: dict[str, str], options: list[str],
                   ptx: bool = False) -> tuple[bytes, str | None, str]:
    """(cubin, the PTX when asked for, else None, NVRTC's log) of one NVRTC compile; CompileError on failure."""
    names = sorted(headers)
    prog = call(nvrtc.nvrtcCreateProgram, source.encode(), name.encode(), len(names),
                [headers[n].encode() for n in names], [n.encode() for n in names])
    try:
        err, = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        log_text = _program_log(prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(name, log_text, options, source)
        cubin = _program_output(prog, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
        text = _program_output(prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX).rstrip(b"\0").decode() if ptx else None
        return cubin, text, log_text
    finally:
        call(nvrtc.nvrtcDestroyProgram, prog)


def _program_output(prog, get_size, get) -> bytes:
    out = bytearray(call(get_size, prog))  # writable buffer: never hand NVRTC an immutable bytes object
    call(get, prog, out)
    return bytes(out)


def _program_log(prog) -> str:
    size = call(nvrtc.nvrtcGetProgramLogSize, prog)
    buf = bytearray(max(size, 1))
    call(nvrtc.nvrtcGetProgramLog, prog, buf)
    return bytes(buf).split(b"\0", 1)[0].decode(errors="replace")


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
