"""compiler.compile_all: what the kernel caches lack, compiled in child processes at once (NVRTC, no GPU).

A cold start compiles through it (module.start_compiling, on a thread of its own, while each file loads at its
first use); these check that a child's cubin is the one an in-process compile makes, that a warm cache starts no
process, that a unit under way is waited for and not compiled twice, and that a child's failure reaches the caller
as the error an in-process compile raises."""
from __future__ import annotations

import logging
import subprocess
import threading
import time
import types

import pytest

from tileinfer.cuda import CompileError, compiler
from tileinfer.cuda.compiler import compile_all, compile_file, cuda_src_dir, part_defines
from tileinfer.cuda.module import entry_points

# Two whole files and one part of a file compiled in parts (sm_90: gemm_tma's wgmma kernels are traps there,
# quick to compile).
UNITS = [("rmsnorm.cu", None), ("embedding.cu", None), ("gemm_tma.cu", {"KERNEL_PART": 1})]


def use_cache(monkeypatch, path):
    """An empty on-disk cache at `path`, an empty in-memory cache and zeroed STATS, as a new process has."""
    monkeypatch.setenv("TILEINFER_CACHE", str(path))
    monkeypatch.setattr(compiler, "_memory_cache", {})
    monkeypatch.setattr(compiler, "STATS", compiler.CompileStats())
    return path / "kernels"


def test_children_make_the_cubins_an_in_process_compile_makes(tmp_path, monkeypatch, capsys, caplog):
    parallel_dir = use_cache(monkeypatch, tmp_path / "parallel")
    with caplog.at_level(logging.INFO, logger=compiler.log.name):
        compile_all(UNITS, "sm_90", progress=True)
    line = [r for r in caplog.records if r.msg == compiler.COMPILE_LOG]
    assert len(line) == 1, caplog.text
    count, wall, cores, processes, user, system, thousand_faults, from_disk, nvrtc_seconds, longest, longest_seconds = \
        line[0].args
    assert count == len(UNITS) and 0 < nvrtc_seconds < processes <= wall * cores + 0.1, line[0].getMessage()
    # each child's own CPU seconds and page faults (an interpreter and libnvrtc map some thousands of pages)
    assert 0 < user + system <= processes + 0.1 and thousand_faults > len(UNITS) and from_disk >= 0, \
        line[0].getMessage()
    assert longest in ("rmsnorm.cu", "embedding.cu", "gemm_tma.cu (part 1)") and longest_seconds <= wall + 0.1
    assert compiler.STATS.compiled == len(UNITS), compiler.STATS
    assert len(list(parallel_dir.glob("*.cubin"))) == len(UNITS) and not list(parallel_dir.glob("*.tmp"))
    parallel = [compile_file(f, "sm_90", d) for f, d in UNITS]
    assert compiler.STATS.compiled == len(UNITS), f"the cubins were compiled again: {compiler.STATS}"
    bar = capsys.readouterr().err
    assert "compiling kernels" in bar and "left: " in bar and "gemm_tma.cu" in bar, bar

    use_cache(monkeypatch, tmp_path / "serial")
    serial = [compile_file(f, "sm_90", d) for f, d in UNITS]
    assert compiler.STATS.compiled == len(UNITS), compiler.STATS
    for (f, d), a, b in zip(UNITS, parallel, serial):
        assert a[:4] == b"\x7fELF" and a == b, f"{f} {d}: the child's cubin ({len(a)} bytes) differs ({len(b)} bytes)"
    assert entry_points(parallel[2]) and all("_s2_" in name for name in entry_points(parallel[2])), \
        f"part 1 of gemm_tma.cu holds the KS = 2 builds, found {entry_points(parallel[2])}"


def test_a_warm_cache_starts_no_process(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path)
    compile_all(UNITS[:1], "sm_90")
    assert compiler.STATS.compiled == 1, compiler.STATS

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started with a warm cache: {args}")

    monkeypatch.setattr(subprocess, "run", no_process)
    monkeypatch.setattr(subprocess, "Popen", no_process)
    compile_all(UNITS[:1], "sm_90")  # in memory
    monkeypatch.setattr(compiler, "_memory_cache", {})  # as a new process: on disk only
    compile_all(UNITS[:1], "sm_90")
    filename, defines = UNITS[0]
    compile_file(filename, "sm_90", defines)
    assert (compiler.STATS.compiled, compiler.STATS.disk_hits) == (1, 1), compiler.STATS


def broken_sources(tmp_path, monkeypatch):
    """A private cuda_src with a good file and one whose line 3 lacks its semicolon (NVRTC says so at line 4)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "common.cuh").write_text((cuda_src_dir() / "common.cuh").read_text())
    (src / "good.cu").write_text('#include "common.cuh"\nextern "C" __global__ void good(float *x) { x[0] = 1.f; }\n')
    (src / "broken.cu").write_text('#include "common.cuh"\nextern "C" __global__ void broken(float *x) {\n'
                                   '    x[0] = 1.0f\n}\n')
    monkeypatch.setenv("TILEINFER_CUDA_SRC", str(src))


def test_a_compile_error_in_a_child_is_raised_as_compile_error(tmp_path, monkeypatch):
    cache = use_cache(monkeypatch, tmp_path / "cache")
    broken_sources(tmp_path, monkeypatch)
    with pytest.raises(CompileError) as info:
        compile_all([("good.cu", None), ("broken.cu", {"KERNEL_PART": 0})], "sm_90")
    err = info.value
    message = str(err)
    assert err.name == "broken.cu" and "error" in err.log and "broken.cu(4): error" in err.log, err.log
    assert message.startswith("NVRTC failed to compile broken.cu with options ") and err.log.strip() in message
    assert "   3 |     x[0] = 1.0f" in message, message  # the numbered source, as an in-process compile gives
    assert "-arch=sm_90" in err.options and "-DKERNEL_PART=0" in err.options, err.options
    assert "Traceback" not in message, message
    assert not list(cache.glob("broken-*")), "a failed compile left a cubin in the cache"


def test_a_child_that_fails_otherwise_reports_its_output(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "cache")
    broken_sources(tmp_path, monkeypatch)
    child = tmp_path / "child.py"
    child.write_text("import sys\nsys.stdin.read()\nsys.exit('no NVRTC library here')\n")
    monkeypatch.setattr(compiler, "CHILD", child)
    with pytest.raises(RuntimeError, match=r"compiling good\.cu .* exit status 1:\nno NVRTC library here"):
        compile_all([("good.cu", None)], "sm_90")
    assert compiler.STATS.compiled == 0, compiler.STATS


def test_part_defines_read_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEINFER_CUDA_SRC", str(tmp_path))
    (tmp_path / "whole.cu").write_text("// KERNEL_PARTS in a comment is no define\n")
    (tmp_path / "split.cu").write_text("#define KERNEL_PARTS 3\n#if IN_PART(0)\n#endif\n")
    (tmp_path / "one.cu").write_text("#define KERNEL_PARTS 1\n")
    assert part_defines("whole.cu") == [None]
    assert part_defines("split.cu") == [{"KERNEL_PART": 0}, {"KERNEL_PART": 1}, {"KERNEL_PART": 2}]
    with pytest.raises(ValueError, match="one.cu: define KERNEL_PARTS once, as a number of parts >= 2"):
        part_defines("one.cu")


def test_entry_points_refuses_what_is_not_a_cubin():
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF image"):
        entry_points(b"// PTX, not a cubin\n")


def test_the_table_of_compile_times_names_every_unit():
    """compile_seconds.py (scripts/compile_seconds.py writes it) names each unit of cuda_src/ and nothing else:
    a file that gains or loses parts needs the table written again."""
    units = {name if d is None else f"{name}:{d['KERNEL_PART']}" for name in compiler.kernel_files()
             for d in part_defines(name)}
    assert set(compiler.UNIT_SECONDS) == units, (
        f"run python3 scripts/compile_seconds.py: units without a time {sorted(units - set(compiler.UNIT_SECONDS))}, "
        f"times of no unit {sorted(set(compiler.UNIT_SECONDS) - units)}")
    assert all(s > 0 for s in compiler.UNIT_SECONDS.values())


def test_the_longest_units_start_first(tmp_path, monkeypatch):
    """On one core the children run in compile_all's order: the table's longest first, a unit it does not name
    (new.cu) before them all."""
    use_cache(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("TILEINFER_CUDA_SRC", str(tmp_path))
    for name in ("new.cu", "short.cu", "long.cu"):
        (tmp_path / name).write_text("#define KERNEL_PARTS 2\n" if name == "long.cu" else "// one unit\n")
    monkeypatch.setattr(compiler, "UNIT_SECONDS", {"short.cu": 0.5, "long.cu:0": 2.0, "long.cu:1": 3.0})
    monkeypatch.setattr(compiler.os, "sched_getaffinity", lambda pid: {0})
    started = []

    def child(unit):
        started.append(compiler.unit_key(unit))
        return b"\x7fELF", compiler.ChildTimes(0.0)
    monkeypatch.setattr(compiler, "_compile_in_child", child)
    units = [("short.cu", None), ("long.cu", {"KERNEL_PART": 0}), ("new.cu", None), ("long.cu", {"KERNEL_PART": 1})]
    compile_all(units, "sm_90")
    assert started == ["new.cu", "long.cu:1", "long.cu:0", "short.cu"], started


def test_load_all_waits_for_the_compile_start_compiling_began_and_counts_it(tmp_path, monkeypatch):
    from tileinfer.cuda import module
    kernels = use_cache(monkeypatch, tmp_path)
    files = ["rmsnorm.cu", "embedding.cu"]
    loaded = []
    monkeypatch.setattr(module, "kernel_files", lambda: files)
    monkeypatch.setattr(module, "compute_capability", lambda ordinal: (9, 0))  # no GPU here: the device's answer
    monkeypatch.setattr(module, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(module, "load_module", lambda name: loaded.append(name) or types.SimpleNamespace(load=lambda: None))
    monkeypatch.setattr(module, "_compiling", None)
    module.start_compiling(0)
    assert module._compiling is not None
    assert module.load_all() == 2 and compiler.STATS.compiled == 2, compiler.STATS  # nothing compiled twice
    assert sorted(p.name.split("-")[0] for p in kernels.glob("*.cubin")) == ["embedding", "rmsnorm"]
    assert loaded == files and module._compiling is None
    assert module.load_all() == 0, "a warm cache compiles nothing"


def test_load_all_raises_the_error_of_the_compile_start_compiling_began(monkeypatch):
    from tileinfer.cuda import module

    def failing(units, arch, *rest):
        raise CompileError("rmsnorm.cu", "error: expected a ';'", [f"-arch={arch}"], "")

    monkeypatch.setattr(module, "compute_capability", lambda ordinal: (9, 0))
    monkeypatch.setattr(module, "compile_all", failing)
    monkeypatch.setattr(module, "_compiling", None)
    module.start_compiling(0)
    with pytest.raises(CompileError, match="expected a ';'"):
        module.load_all()
    assert module._compiling is None


def gated_children(monkeypatch, cubin=b"\x7fELF from the child"):
    """compile_all's children replaced by ones that wait for the returned event (a compile under way until it is
    set); an in-process compile fails the test."""
    release = threading.Event()

    def child(unit):
        assert release.wait(30), "the test never released the child"
        if unit.name == "bad.cu":
            raise CompileError(unit.name, "error: expected a ';'", unit.options, unit.source)
        return cubin, compiler.ChildTimes(0.1)

    def in_process(*args, **kwargs):
        raise AssertionError("compiled again in this process")

    monkeypatch.setattr(compiler, "_compile_in_child", child)
    monkeypatch.setattr(compiler, "_nvrtc_compile", in_process)
    return release


def wait_until_under_way(seconds: float = 30.0) -> None:
    """Until a compile_all on another thread has its units under way (compiler._in_flight), at most `seconds`."""
    for _ in range(int(seconds / 0.01)):
        if compiler._in_flight:
            return
        time.sleep(0.01)
    raise AssertionError(f"no compile under way after {seconds} s")


def test_a_unit_under_way_on_another_thread_is_waited_for_not_compiled_again(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path)
    monkeypatch.setattr(compiler, "_in_flight", {})
    release = gated_children(monkeypatch)
    background = threading.Thread(target=compile_all, args=([("rmsnorm.cu", None)], "sm_90"))
    background.start()
    wait_until_under_way()
    compile_all([("rmsnorm.cu", None)], "sm_90")  # starts nothing: the unit is under way
    threading.Timer(0.2, release.set).start()
    assert compile_file("rmsnorm.cu", "sm_90") == b"\x7fELF from the child"  # once the child ends
    background.join(30)
    assert (compiler.STATS.compiled, compiler.STATS.waits) == (1, 1), compiler.STATS
    assert not compiler._in_flight
    assert compile_file("rmsnorm.cu", "sm_90") == b"\x7fELF from the child" and compiler.STATS.memory_hits == 1


def test_the_error_of_a_unit_under_way_reaches_the_thread_waiting_for_it(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path)
    monkeypatch.setenv("TILEINFER_CUDA_SRC", str(tmp_path))
    (tmp_path / "bad.cu").write_text("__global__ void k() { int x }\n")
    monkeypatch.setattr(compiler, "_in_flight", {})
    release = gated_children(monkeypatch)
    errors = []

    def background():
        try:
            compile_all([("bad.cu", None)], "sm_90")
        except CompileError as e:
            errors.append(e)
    thread = threading.Thread(target=background)
    thread.start()
    wait_until_under_way()
    threading.Timer(0.2, release.set).start()
    with pytest.raises(CompileError, match="expected a ';'"):
        compile_file("bad.cu", "sm_90")
    thread.join(30)
    assert len(errors) == 1 and not compiler._in_flight


def test_start_compiling_starts_the_first_units_first_and_the_later_files_last(monkeypatch):
    from tileinfer.cuda import module
    calls = []
    monkeypatch.setattr(module, "compute_capability", lambda ordinal: (9, 0))
    monkeypatch.setattr(module, "compile_all", lambda *args: calls.append(args))
    monkeypatch.setattr(module, "_compiling", None)
    module.start_compiling(0, progress=True)
    module._compiling[0].result(30)
    assert calls == [(module.every_unit(), "sm_90a", True, module.FIRST, module.LATER_FILES)], calls
    assert module.LATER_FILES and set(module.LATER_FILES) <= {f for f, _ in module.every_unit()}


def test_the_first_units_start_first_the_last_files_last_and_the_bar_counts_the_first(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("TILEINFER_CUDA_SRC", str(tmp_path))
    for name in ("late.cu", "short.cu", "long.cu", "first.cu"):
        (tmp_path / name).write_text(f"// {name}\n")
    monkeypatch.setattr(compiler, "UNIT_SECONDS", {"short.cu": 0.5, "long.cu": 2.0, "late.cu": 3.0, "first.cu": 0.1})
    monkeypatch.setattr(compiler.os, "sched_getaffinity", lambda pid: {0})
    started, bars = [], []

    def child(unit):
        started.append(unit.name)
        return b"\x7fELF", compiler.ChildTimes(0.0)
    monkeypatch.setattr(compiler, "_compile_in_child", child)

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n, self.disable = total, 0, False
            bars.append(self)

        def set_postfix_str(self, text, refresh):
            assert text == "left: first.cu", text

        def update(self):
            self.n += 1

        def close(self):
            self.disable = True
    monkeypatch.setattr("tqdm.tqdm", Bar)
    compile_all([("short.cu", None), ("late.cu", None), ("long.cu", None), ("first.cu", None)], "sm_90", progress=True,
                first=["first.cu"], last=["late.cu"])
    assert started == ["first.cu", "long.cu", "short.cu", "late.cu"], started
    assert len(bars) == 1 and (bars[0].total, bars[0].n, bars[0].disable) == (1, 1, True)  # what a first request needs
