"""Loaded cubins and kernel launches through `cuLaunchKernelEx`.

Every launch on a Hopper GPU carries the programmatic-stream-serialization attribute
(programmatic dependent launch): a kernel may begin launching while the kernel before it in the
stream is still running, and its blocks wait in `pdl_start()` (cuda_src/common.cuh) until that
kernel has finished. Launch latency and the ramp-up of each kernel then overlap the tail of the one
before; a decode step is ~300 short kernels, so this is a sizeable part of its time. Every kernel
in cuda_src/ calls `pdl_start()` before touching data another kernel writes (a CPU test checks
this). Set TILEINFER_PDL=0 to launch without the attribute (plain stream order).

Kernel arguments are passed explicitly typed: a `DeviceArray` (its pointer), `None` (a
null pointer) or a ctypes scalar (`ctypes.c_int32(n)`, `ctypes.c_float(eps)`, ...). The
launch packs them into the `void*[]` array the driver copies from, so the same call works
eagerly and while a stream is being captured into a graph.
"""
from __future__ import annotations

import array
import ctypes
import logging
import os
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache

from cuda.bindings import driver

from . import compiler
from .compiler import compile_all, compile_file, kernel_files, part_defines
from .driver import call, compute_capability, get_device, last_work
from .kernel_units import FIRST, PART_OF
from .memory import DeviceArray

log = logging.getLogger(__name__)

I32, U32, I64, U64, F32 = ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float


def _pdl_attributes() -> list:
    """The launch attributes of every launch: programmatic dependent launch (every device is sm_90 or
    newer: Device refuses older ones), unless TILEINFER_PDL=0."""
    if os.environ.get("TILEINFER_PDL", "1") == "0":
        return []
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return [attr]


def pack_arguments(args) -> array.array:
    """The `void*[]` array cuLaunchKernelEx reads a kernel's arguments through, for `args` (n of them): its
    first n entries are the arguments' addresses, and its last n hold the device pointers those of the
    DeviceArray and None arguments point at (a ctypes argument is read where it lies). The launch passes
    the address of the array's first entry; the array must stay alive until the driver has copied the
    values (the call returns after that)."""
    n = len(args)
    slots = array.array("Q", bytes(16 * n))
    base = slots.buffer_info()[0]
    for i, arg in enumerate(args):
        if type(arg) is DeviceArray:
            slots[n + i] = arg.ptr
            slots[i] = base + 8 * (n + i)
        elif arg is None:  # a null pointer: its slot stays 0
            slots[i] = base + 8 * (n + i)
        else:
            try:  # a ctypes scalar; a ctypes array goes by value (the driver copies its bytes): a tensor map
                slots[i] = ctypes.addressof(arg)
            except TypeError:
                if not isinstance(arg, DeviceArray):
                    raise TypeError(f"kernel argument {arg!r}: pass a DeviceArray, None, a ctypes scalar (e.g. "
                                    "ctypes.c_int32(n)) or a ctypes array (by value)") from None
                slots[n + i] = arg.ptr  # a subclass of DeviceArray
                slots[i] = base + 8 * (n + i)
    return slots


class _Launch:
    """What Kernel.launch enqueued, formatted only when an error names it (driver.last_work)."""
    __slots__ = ("name", "grid", "block", "smem")

    def __init__(self, name: str, grid: tuple, block: tuple, smem: int):
        self.name, self.grid, self.block, self.smem = name, grid, block, smem

    def __str__(self) -> str:
        return f"kernel {self.name} grid={self.grid} block={self.block} smem={self.smem}"


class Kernel:
    def __init__(self, module: "Module", name: str):
        self.module, self.name = module, name
        self.function = module.function(name)
        self.max_dynamic_smem = 0
        self.prefers_shared = False
        self._config = driver.CUlaunchConfig()
        attrs = _pdl_attributes()
        if attrs:
            self._config.attrs = attrs
        self._config.numAttrs = len(attrs)

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        """Allow more than 48 KB of dynamic shared memory (needed before such a launch)."""
        if nbytes > self.max_dynamic_smem:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            call(driver.cuFuncSetAttribute, self.function, attr, nbytes, detail=self.name)
            self.max_dynamic_smem = nbytes

    def prefer_shared_memory(self) -> None:
        """Run this kernel in the SM configuration with the most shared memory (the least L1 cache), the one
        the kernels that fill shared memory (the tensor-core GEMMs, attention) run in; for a kernel with
        little shared memory the driver otherwise picks one with a large L1 (Nsight Compute: rmsnorm 32 KB
        of shared memory, the swap-AB GEMM and decode attention 228 KB). An SM is in one configuration at a
        time, so blocks of kernels in two cannot share it; a small kernel between two such kernels ran faster
        in their configuration (docs/benchmarks.md, "The batched products")."""
        if not self.prefers_shared:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            carveout = driver.CUshared_carveout.CU_SHAREDMEM_CARVEOUT_MAX_SHARED
            call(driver.cuFuncSetAttribute, self.function, attr, int(carveout), detail=self.name)
            self.prefers_shared = True

    def attribute(self, attr) -> int:
        return call(driver.cuFuncGetAttribute, attr, self.function)

    def max_active_clusters(self, cluster: int, threads: int, smem: int) -> int:
        """Thread-block clusters of this kernel (compiled with __cluster_dims__(cluster, 1, 1)) that the GPU
        holds at once with `threads` threads and `smem` bytes of dynamic shared memory a block
        (cuOccupancyMaxActiveClusters: a cluster's blocks must share one GPC)."""
        if smem > 48 * 1024:
            self.set_max_dynamic_smem(smem)
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = cluster, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
        cfg.sharedMemBytes = smem
        cfg.numAttrs = 0
        return call(driver.cuOccupancyMaxActiveClusters, self.function, cfg, detail=self.name)

    def max_active_blocks(self, threads: int, smem: int) -> int:
        """Blocks of this kernel one SM holds at once with `threads` threads and `smem` bytes of dynamic
        shared memory a block (cuOccupancyMaxActiveBlocksPerMultiprocessor: registers, shared memory)."""
        if smem > 48 * 1024:
            self.set_max_dynamic_smem(smem)
        return call(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor, self.function, threads, smem,
                    detail=self.name)

    def launch(self, grid, block, args, stream, smem: int = 0) -> None:
        grid = (*grid, 1, 1)[:3]
        block = (*block, 1, 1)[:3]
        if min(grid) <= 0:
            return  # nothing to do (an empty batch); launching a 0-sized grid is an error
        pointers = pack_arguments(args)
        if smem > self.max_dynamic_smem and smem > 48 * 1024:
            self.set_max_dynamic_smem(smem)
        what = last_work[0] = _Launch(self.name, grid, block, smem)
        c = self._config
        c.gridDimX, c.gridDimY, c.gridDimZ = grid
        c.blockDimX, c.blockDimY, c.blockDimZ = block
        c.sharedMemBytes, c.hStream = smem, stream.handle
        call(driver.cuLaunchKernelEx, c, self.function, pointers.buffer_info()[0], 0, detail=what)


class Module:
    """One cuda_src file: each of its parts (one, unless the file is compiled in parts: compiler.part_defines)
    compiled, or waited for while another thread compiles it, and loaded at the first lookup of a kernel it holds.
    Which part holds a kernel: kernel_units.PART_OF; a kernel it does not name (the table not yet written again
    after a change to the file) is looked for in every part."""

    def __init__(self, filename: str, arch: str, parts: list[dict[str, object] | None]):
        self.filename, self.arch, self.parts = filename, arch, parts
        self.label = f"{filename} ({arch})"
        self._images: list[bytes | None] = [None] * len(parts)  # each loaded part's cubin, kept alive while loaded
        self.handles: list = [None] * len(parts)                # each part's CUmodule, once loaded
        self._kernels: dict[str, Kernel] = {}

    def part(self, p: int):
        """Part p's CUmodule, compiled (or its compile waited for, or read from the cache) and loaded the first time."""
        if self.handles[p] is None:
            start, waits = time.perf_counter(), compiler.STATS.waits
            cubin = compile_file(self.filename, self.arch, self.parts[p])
            if compiler.STATS.waits != waits:
                log.info(LOAD_LOG, self.filename if len(self.parts) == 1 else f"{self.filename} (part {p})",
                         time.perf_counter() - start)
            self.handles[p] = call(driver.cuModuleLoadData, cubin, detail=self.label)
            self._images[p] = cubin
        return self.handles[p]

    def load(self) -> None:
        """Every part loaded."""
        for p in range(len(self.parts)):
            self.part(p)

    @property
    def names(self) -> list[str]:
        """Every entry point of the file, sorted (every part loaded)."""
        self.load()
        return sorted(name for image in self._images for name in entry_points(image))

    def holder(self, name: str) -> int:
        """The part that holds entry point `name`; LookupError when none does."""
        known = PART_OF.get(self.filename, {}).get(name)
        if known is not None:
            return known
        for p in range(len(self.parts)):  # a whole file, or a kernel the table does not name
            self.part(p)
            if name in entry_points(self._images[p]):
                return p
        raise LookupError(f"{self.label} has no kernel {name!r}; it has {', '.join(self.names)}")

    def function(self, name: str):
        """The CUfunction of entry point `name`, from the part that holds it."""
        return call(driver.cuModuleGetFunction, self.part(self.holder(name)), name.encode(), detail=name)

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, name)
        return self._kernels[name]


def entry_points(cubin: bytes) -> list[str]:
    """The kernels of a cubin: the global function symbols of its ELF symbol table (a kernel's
    device helpers are local)."""
    if cubin[:6] != b"\x7fELF\x02\x01":
        raise ValueError(f"not a 64-bit little-endian ELF image (a cubin): it starts {cubin[:8]!r}")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    # section headers: (name, type, flags, addr, offset, size, link, info, addralign, entsize)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name, info = struct.unpack_from("<IB", cubin, at)
            if info == 0x12:  # STB_GLOBAL << 4 | STT_FUNC
                names.append(cubin[strings + name:cubin.index(b"\0", strings + name)].decode())
    return names


def nvrtc_arch(compute_capability: tuple[int, int]) -> str:
    """The arch the kernels are compiled for on a device of this compute capability."""
    major, minor = compute_capability
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"  # Hopper's wgmma, setmaxnreg need 'a'


def device_arch() -> str:
    """The arch the kernels are compiled for on the current device."""
    return nvrtc_arch(get_device().info.compute_capability)


@cache
def load_module(filename: str) -> Module:
    """`cuda_src/<filename>` for the current device, at its first kernel's first lookup (or in load_all): what of it
    neither kernel cache holds nor a compile has under way (start_compiling's) compiled now, in parallel; each part
    loaded at its first use (Module.part)."""
    arch = device_arch()
    parts = part_defines(filename)
    compile_all([(filename, defines) for defines in parts], arch)
    return Module(filename, arch, parts)


def kernel(filename: str, name: str) -> Kernel:
    return load_module(filename).kernel(name)


# Compiled after every other file: what only products of more than 64 rows launch (the tensor-core GEMM of long
# prompts and large batches), so that the kernels of a first short prompt and its decode steps are ready first.
# tests/test_host_launches.py checks that such steps of the presets' shapes launch none of them.
LATER_FILES = ("gemm_tma.cu",)
# Module.part's line when a part's first use waited for its compile (INFO): what a cold start's first step waits for.
LOAD_LOG = "%s loaded in %.2f s, waiting for its compile"


def every_unit() -> list[tuple[str, dict[str, object] | None]]:
    """Every compile unit of cuda_src/: (file, its part's defines or None)."""
    return [(name, defines) for name in kernel_files() for defines in part_defines(name)]


# The compile start_compiling began on a thread, until load_all waits for it: (its future, its arch,
# compiler.STATS.compiled then).
_compiling: tuple[Future, str, int] | None = None


def start_compiling(ordinal: int, progress: bool = False) -> None:
    """Begin compiling what the kernel caches lack of cuda_src/ for device `ordinal` (in parallel, with a
    progress bar when asked) on a thread of its own, before the device's context opens: the compiles (child
    processes) overlap the device's opening and the weights' load, and each part of a file loads at its first use
    (Module.part), once its own compile is done. The units a short first request launches (kernel_units.FIRST) start
    first (the progress bar counts them), LATER_FILES after every other; the rest may still compile while a short
    prompt runs. A process that ends before they are done lets them finish first, at its exit, so that the next run
    finds the kernel cache filled."""
    global _compiling
    if _compiling is not None:
        return
    arch, before = nvrtc_arch(compute_capability(ordinal)), compiler.STATS.compiled
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile")
    _compiling = (pool.submit(compile_all, every_unit(), arch, progress, FIRST, LATER_FILES), arch, before)
    pool.shutdown(wait=False)  # its thread ends with the compile


def load_all(progress: bool = False) -> int:
    """Compile what the kernel caches lack of cuda_src/ (in parallel, with a progress bar when asked), or wait
    for the compile start_compiling began, and load every file now: a server's start-up, so that it never compiles
    or loads a file while it serves, nor while it captures its graphs. Returns the kernels compiled for it (0 with a
    warm cache), start_compiling's included."""
    global _compiling
    compiled, started_arch = compiler.STATS.compiled, None
    if _compiling is not None:
        (future, started_arch, compiled), _compiling = _compiling, None
        future.result()  # its CompileError, if any, is raised here
    arch = device_arch()
    if started_arch != arch:  # none started, or for another arch: each unit read and keyed again is not free
        compile_all(every_unit(), arch, progress, FIRST, LATER_FILES)
    for name in kernel_files():
        load_module(name).load()
    return compiler.STATS.compiled - compiled
