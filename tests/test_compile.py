"""NVRTC compilation and the kernel cache, on the CPU (no GPU needed: NVRTC comes from pip).

Every cuda_src/*.cu must compile for Hopper (sm_90, and sm_90a, which load_module picks on an
H100/H200) into an ELF cubin that exports the entry points the launchers call, and whose PTX waits
for the kernel before it; a file compiled in parts must hold each entry point in exactly one part.
Each (file, arch) is compiled once, several at a time (NVRTC releases the
GIL), and both checks read that one compile. The cache must
compile each key once (STATS.compiled), serve it from disk in a fresh process (disk_hits) and
from memory in this one (memory_hits), and change its key with every input that changes the
binary. NVRTC failures must surface as CompileError with the log and numbered source.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tileinfer.cuda import CompileError, compiler, gpu_available
from tileinfer.cuda.compiler import (cache_key, compile_all, compile_file, compile_source, cubin_and_ptx, cuda_src_dir,
                                     part_defines, read_headers)
from tileinfer.cuda.kernel_units import PART_OF
from tileinfer.cuda.module import entry_points

CU_FILES = sorted(p.name for p in cuda_src_dir().glob("*.cu"))
ARCHS = ("sm_90", "sm_90a")
ELF_MAGIC = b"\x7fELF"

# The entry points tileinfer/kernels/*.py launch, by file (a new file simply has no entry here).
ENTRY_POINTS = {
    "embedding.cu": ["embedding", "resolve_tokens", "fetch_step"],
    "rmsnorm.cu": ["rmsnorm"],
    "attn_input.cu": ["attn_input", "attn_input_int8"],
    "gemm_tma.cu": [f"gemm_tma{w}{s}_e{e}" for w in ("", "_n128") for s in ("", "_s2", "_s3", "_s4") for e in range(4)]
    + [f"gemm_tma_n{w}_e{e}" for w in (96, 160) for e in range(5)]
    + [f"gemm_tma_n96_s{k}_e{e}" for k in (2, 4) for e in range(5)]
    + [f"gemm_tma_m256_n{w}{s}_e{e}" for w, ss in ((96, ("", "_s4")), (160, ("",))) for s in ss for e in range(5)],
    "gemm_swap.cu": [f"gemm_swap_b{b}_w1_c{k}{r}" for b in ("16", "32", "64", "16d") for k in (1, 2, 4, 8) for r in ("", "_np", "_nc")],
    "gemv.cu": [f"gemv_m{m}_e{e}" for m in (1, 2) for e in range(4)] + ["gemv_pipe_m1_e1", "gemv_pipe_m1_e3",
                                                                              "gemv_argmax_m1_e3", "gemv_pipe_argmax_m1_e3",
                                                                              "gemv_norm_m1_e0", "gemv_norm_m1_e0_b4", "gemv_norm_m1_e2",
                                                                              "gemv_norm_m2_e0", "gemv_norm_m2_e2"],
    "attention_prefill.cu": ["attention", "attention_int8"],
    "attention_decode.cu": ["attention_decode", "attention_int8_decode", "attention_decode_h8", "attention_int8_decode_h8",
                            "attention_decode_h8_fused", "attention_int8_decode_h8_fused"],
    "attention_combine.cu": ["attention_combine"],
    "attention_wg.cu": ["attention_wg"],
    "sampling.cu": ["argmax_rows", "sample_rows"],
}

# A small source that includes our header, so header changes must reach the key.
TINY_SOURCE = """#include "common.cuh"
extern "C" __global__ void tiny(const bf16 *x, float *y) { y[threadIdx.x] = bf16_to_f32(x[threadIdx.x]) * SCALE; }
"""


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty on-disk cache in tmp_path, an empty in-memory cache and zeroed STATS (all restored after)."""
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(compiler, "_memory_cache", {})
    monkeypatch.setattr(compiler, "STATS", compiler.CompileStats())
    return tmp_path / "kernels"


def stats() -> tuple[int, int, int]:
    s = compiler.STATS
    return s.compiled, s.disk_hits, s.memory_hits


def test_kernel_sources_are_found():
    assert cuda_src_dir().is_dir(), cuda_src_dir()
    assert set(ENTRY_POINTS) <= set(CU_FILES), f"missing kernel files: {set(ENTRY_POINTS) - set(CU_FILES)}"


@pytest.fixture(scope="module")
def builds():
    """(file, arch) -> a future of its (cubin, PTX): every kernel file compiled once for each arch,
    as many at once as there are cores (the slowest file bounds the time)."""
    jobs = [(filename, arch) for filename in CU_FILES for arch in ARCHS]
    # the slowest files first, so they do not start last
    jobs.sort(key=lambda job: (cuda_src_dir() / job[0]).stat().st_size * (2 if job[1] == "sm_90a" else 1),
              reverse=True)
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        futures = {job: pool.submit(cubin_and_ptx, *job) for job in jobs}
        yield futures


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", CU_FILES)
def test_kernel_file_compiles(filename, arch, builds):
    cubin, _ = builds[filename, arch].result()  # a CompileError is raised here
    assert isinstance(cubin, bytes) and len(cubin) > 1024, f"{filename} {arch}: {len(cubin)}-byte cubin"
    assert cubin[:4] == ELF_MAGIC, f"{filename} {arch}: not an ELF image, starts {cubin[:8]!r}"
    # The names the launchers pass to kernel() are kernels of the cubin (as Module looks them up).
    missing = sorted(set(ENTRY_POINTS.get(filename, [])) - set(entry_points(cubin)))
    assert not missing, f"{filename} {arch}: cubin lacks entry points {missing}"


SPLIT_FILES = [filename for filename in CU_FILES if part_defines(filename) != [None]]


def test_the_longest_files_are_compiled_in_parts():
    assert {"gemm_swap.cu", "gemm_tma.cu"} <= set(SPLIT_FILES), f"files compiled in parts: {SPLIT_FILES}"
    assert set(PART_OF) == set(SPLIT_FILES), "kernel_units.PART_OF names other files: run scripts/kernel_units.py"


@pytest.mark.parametrize("filename", SPLIT_FILES)
def test_each_entry_point_is_in_exactly_one_part(filename, builds, fresh_cache):
    # load_module compiles such a file once a part (-DKERNEL_PART=p) and looks each kernel up in the part
    # that holds it. sm_90: the same entry points as sm_90a (its wgmma kernels trap), quicker to compile.
    whole = entry_points(builds[filename, "sm_90"].result()[0])
    parts = part_defines(filename)
    compile_all([(filename, defines) for defines in parts], "sm_90")
    held = [entry_points(compile_file(filename, "sm_90", defines)) for defines in parts]
    assert all(held), f"{filename}: a part holds no kernel: {held}"
    names = [name for part in held for name in part]
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice, f"{filename}: entry points in more than one part: {twice}"
    assert sorted(names) == sorted(whole), \
        f"{filename}: the parts miss {sorted(set(whole) - set(names))} and add {sorted(set(names) - set(whole))}"
    # Module loads the part that kernel_units.PART_OF names (looking through every part only for a name it lacks)
    assert PART_OF.get(filename) == {name: p for p, part in enumerate(held) for name in part}, \
        f"{filename}: tileinfer/cuda/kernel_units.py's PART_OF is out of date: run python3 scripts/kernel_units.py"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", CU_FILES)
def test_every_kernel_waits_for_the_kernel_before_it(filename, arch, builds):
    # Kernels are launched with programmatic dependent launch (tileinfer/cuda/module.py): one may
    # start while the kernel before it runs. Each entry point must therefore reach pdl_start()'s
    # griddepcontrol.wait before any store or atomic (loads of weights may come first). sm_90a's
    # PTX holds the wgmma / TMA kernels that sm_90's leaves empty.
    _, ptx = builds[filename, arch].result()
    entries = re.split(r"^\.(?:visible )?\.entry\s+", ptx, flags=re.MULTILINE)[1:]
    assert entries, f"no entry points in the PTX of {filename} ({arch})"
    for body in entries:
        name = body.split("(", 1)[0]
        # gemm_swap.cu's flow consumers (_fc, sm_90a) wait instead for counts the kernel before them writes as it
        # goes (an acquire load of each), and for nothing before that kernel, which had passed its own wait
        # before they could start.
        marks = ("griddepcontrol.wait", "ld.acquire.gpu") if name.endswith("_fc") else ("griddepcontrol.wait",)
        wait = min((at for at in map(body.find, marks) if at >= 0), default=-1)
        assert wait >= 0, f"{filename} ({arch}): kernel {name} never calls pdl_start()"
        early = re.search(r"\b(st\.global|st\.shared|atom\.|red\.)", body[:wait])
        assert early is None, f"{filename} ({arch}): kernel {name} has {early.group(1)} before pdl_start()"
        assert "griddepcontrol.launch_dependents" in body, \
            f"{filename} ({arch}): kernel {name} never lets the next start"


def test_disk_then_memory_cache(fresh_cache):
    first = compile_file("rmsnorm.cu", "sm_90")
    assert stats() == (1, 0, 0), compiler.STATS
    files = sorted(fresh_cache.iterdir())
    assert [f.suffix for f in files] == [".cubin"], f"expected one cubin and no temp files, found {files}"
    assert files[0].read_bytes() == first

    compiler._memory_cache.clear()  # as a new process would start
    second = compile_file("rmsnorm.cu", "sm_90")
    assert second == first
    assert stats() == (1, 1, 0), f"expected a disk hit and no recompile, STATS = {compiler.STATS}"

    third = compile_file("rmsnorm.cu", "sm_90")
    assert third == first
    assert stats() == (1, 1, 1), f"expected a memory hit, STATS = {compiler.STATS}"

    compile_file("rmsnorm.cu", "sm_90a")  # another arch is another key
    assert stats() == (2, 1, 1), compiler.STATS
    assert len(list(fresh_cache.glob("*.cubin"))) == 2


def test_cache_key_covers_every_input(tmp_path):
    src_dir = cuda_src_dir()
    source = (src_dir / "rmsnorm.cu").read_text()
    headers = read_headers(source, src_dir)
    assert "common.cuh" in headers, f"read_headers found {sorted(headers)}"
    options = [*compiler.BASE_OPTIONS, "-arch=sm_90"]
    base = cache_key(source, headers, options, "sm_90")
    assert cache_key(source, dict(headers), list(options), "sm_90") == base  # deterministic

    variants = {
        "define": cache_key(source, headers, options + ["-DFOO=1"], "sm_90"),
        "define value": cache_key(source, headers, options + ["-DFOO=2"], "sm_90"),
        "header": cache_key(source, {**headers, "common.cuh": headers["common.cuh"] + "\n// edited\n"},
                            options, "sm_90"),
        "source": cache_key(source + "\n", headers, options, "sm_90"),
        "arch": cache_key(source, headers, options, "sm_90a"),
    }
    assert base not in variants.values(), variants
    assert len(set(variants.values())) == len(variants), f"two different inputs share a key: {variants}"


def test_defines_and_header_edits_recompile(tmp_path, fresh_cache):
    # A private source directory: a copy of common.cuh that this test edits.
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    (src_dir / "common.cuh").write_text((cuda_src_dir() / "common.cuh").read_text())

    a = compile_source("tiny.cu", TINY_SOURCE, "sm_90", {"SCALE": "2.0f"}, src_dir)
    compile_source("tiny.cu", TINY_SOURCE, "sm_90", {"SCALE": "2.0f"}, src_dir)
    assert stats() == (1, 0, 1), compiler.STATS
    b = compile_source("tiny.cu", TINY_SOURCE, "sm_90", {"SCALE": "3.0f"}, src_dir)
    assert stats() == (2, 0, 1), f"a changed define must recompile, STATS = {compiler.STATS}"
    assert a[:4] == b[:4] == ELF_MAGIC and a != b

    with open(src_dir / "common.cuh", "a") as f:
        f.write("\n__device__ __forceinline__ float tiny_helper(float x) { return x; }\n")
    compile_source("tiny.cu", TINY_SOURCE, "sm_90", {"SCALE": "2.0f"}, src_dir)
    assert stats() == (3, 0, 1), f"an edited header must recompile, STATS = {compiler.STATS}"


def test_compile_error_carries_log_and_numbered_source(fresh_cache):
    source = 'extern "C" __global__ void broken(float *x) {\n    x[0] = 1.0f;\n    x[1] = 2.0f\n}\n'
    with pytest.raises(CompileError) as info:
        compile_source("broken.cu", source, "sm_90")
    err = info.value
    message = str(err)
    assert "error" in err.log and "broken.cu" in err.log, f"unexpected NVRTC log: {err.log!r}"
    assert err.log.strip() in message, message
    assert "   3 |     x[1] = 2.0f" in message, message  # numbered source, 4-wide line numbers
    assert "   4 | }" in message, message
    assert "-arch=sm_90" in message and "-arch=sm_90" in err.options, message
    assert stats() == (0, 0, 0), f"a failed compile counts as nothing, STATS = {compiler.STATS}"
    assert not fresh_cache.exists() or not any(fresh_cache.iterdir()), "a failed compile left files in the cache"


def test_gpu_available_reports_instead_of_raising():
    ok, why = gpu_available()
    assert isinstance(ok, bool), ok
    assert isinstance(why, str) and why, why
    if ok:
        pytest.skip(f"a GPU is present ({why}); the no-GPU answer cannot be checked here")
    assert ok is False
