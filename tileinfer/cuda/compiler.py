"""NVRTC compilation of `cuda_src/*.cu` to cubin, with a content-addressed on-disk cache.

The cache key hashes everything that can change the binary: the source, every header it
includes (recursively, our own `#include "x.cuh"` files), the options, the target arch and
the NVRTC version. Files are written atomically (temp file + rename), so concurrent
processes never read half a cubin. Within a process each key is compiled at most once.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cuda.bindings import nvrtc

from .driver import call

log = logging.getLogger(__name__)

CUDA_SRC = Path(__file__).resolve().parent.parent.parent / "cuda_src"
BASE_OPTIONS = ("-std=c++17", "-default-device", "-lineinfo", "-DNDEBUG")

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


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
    seconds: float = 0.0    # time spent in NVRTC


STATS = CompileStats()
_memory_cache: dict[str, bytes] = {}


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
    src_dir = src_dir or cuda_src_dir()
    headers = read_headers(source, src_dir)
    options = compile_options(arch, defines)
    key = cache_key(source, headers, options, arch)
    if key in _memory_cache:
        STATS.memory_hits += 1
        return _memory_cache[key]
    path = cache_dir() / f"{Path(name).stem}-{arch}-{key[:24]}.cubin"
    if path.is_file():
        cubin = path.read_bytes()
        STATS.disk_hits += 1
    else:
        start = time.perf_counter()
        cubin, _ = _nvrtc_compile(name, source, headers, options)
        STATS.seconds += time.perf_counter() - start
        STATS.compiled += 1
        _write_atomic(path, cubin)
        log.debug("compiled %s for %s in %.2f s", name, arch, time.perf_counter() - start)
    _memory_cache[key] = cubin
    return cubin


def compile_options(arch: str, defines: dict[str, object] | None = None) -> list[str]:
    """NVRTC's options for `arch` (e.g. 'sm_90a') and the -D defines."""
    return [*BASE_OPTIONS, f"-arch={arch}", *(f"-D{k}={v}" for k, v in sorted((defines or {}).items()))]


def cubin_and_ptx(filename: str, arch: str) -> tuple[bytes, str]:
    """One uncached compile of `cuda_src/<filename>` for a real `arch`, with compile_file's options:
    the cubin and the PTX it was assembled from, to check what the compiler produced (e.g. the
    order of instructions in an entry point) without compiling twice."""
    src_dir = cuda_src_dir()
    source = (src_dir / filename).read_text()
    cubin, ptx = _nvrtc_compile(filename, source, read_headers(source, src_dir), compile_options(arch), ptx=True)
    return cubin, ptx


def _nvrtc_compile(name: str, source: str, headers: dict[str, str], options: list[str],
                   ptx: bool = False) -> tuple[bytes, str | None]:
    """(cubin, the PTX when asked for, else None) of one NVRTC compile; CompileError on failure."""
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
        return cubin, text
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
