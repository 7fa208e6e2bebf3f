"""Kernel loading from an empty kernel cache: a server's start-up (module.load_all: what is missing compiled in
child processes at once, each file's parts loaded, and every entry point found in the part that holds it), and a
kernel's first lookup (only the part of its file that holds it loaded)."""
from __future__ import annotations

import pytest

from tileinfer.cuda import compiler
from tileinfer.cuda.compiler import kernel_files, part_defines
from tileinfer.cuda.kernel_units import PART_OF
from tileinfer.cuda.module import load_all, load_module

pytestmark = pytest.mark.gpu


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty kernel cache on disk and in memory, and no file loaded yet; the session's again after."""
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(compiler, "_memory_cache", {})
    monkeypatch.setattr(compiler, "STATS", compiler.CompileStats())
    load_module.cache_clear()
    yield
    load_module.cache_clear()  # later tests load from the session's caches (restored by monkeypatch)


def test_load_all_from_an_empty_cache_finds_every_entry_point(device, empty_cache):
    load_all()
    compiles = sum(len(part_defines(name)) for name in kernel_files())
    assert compiler.STATS.compiled == compiles, f"{compiles} compiles expected, {compiler.STATS}"
    for name in kernel_files():
        module = load_module(name)
        assert len(module.handles) == len(part_defines(name)), module.label
        assert module.names, f"{module.label}: no entry points"
        for entry in module.names:
            assert module.kernel(entry).function is not None  # cuModuleGetFunction in the part holding it
    with pytest.raises(LookupError, match="gemm_tma.cu .* has no kernel 'gemm_tma_s5_e0'; it has gemm_tma_e0"):
        load_module("gemm_tma.cu").kernel("gemm_tma_s5_e0")

    load_module.cache_clear()  # as a new process over the cache on disk: nothing is compiled again
    compiler._memory_cache.clear()
    load_all()
    assert compiler.STATS.compiled == compiles and compiler.STATS.disk_hits == compiles, compiler.STATS


def test_a_kernel_loads_only_the_part_of_its_file_that_holds_it(device, empty_cache):
    module = load_module("gemm_swap.cu")
    assert module.handles == [None] * len(part_defines("gemm_swap.cu"))
    name, part = next((n, p) for n, p in PART_OF["gemm_swap.cu"].items() if p == 3)
    assert module.kernel(name).function is not None
    assert [p for p, handle in enumerate(module.handles) if handle is not None] == [part]
    with pytest.raises(LookupError, match="has no kernel 'gemm_swap_b99'"):
        module.kernel("gemm_swap_b99")  # a name the table lacks is looked for in every part
    assert None not in module.handles

