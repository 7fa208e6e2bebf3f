"""scripts/sass_diff.py: which kernels' machine code a change to cuda_src/ changes (NVRTC, no GPU)."""
from __future__ import annotations

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import sass_diff  # noqa: E402

from tileinfer.cuda.compiler import cuda_src_dir  # noqa: E402

EXTRA = """
extern "C" __global__ void extra_kernel(float *p) {
    pdl_start();
    p[threadIdx.x] = 1.f;
}
"""


def sources(into: Path, rmsnorm_edit=lambda text: text) -> Path:
    into.mkdir()
    for name in ("rmsnorm.cu", "common.cuh"):
        shutil.copy(cuda_src_dir() / name, into / name)
    (into / "rmsnorm.cu").write_text(rmsnorm_edit((into / "rmsnorm.cu").read_text()))
    return into


def test_a_comment_and_a_kernel_beside_leave_the_kernel_and_a_code_change_is_found(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path / "cache"))
    base = sources(tmp_path / "base")
    beside = sources(tmp_path / "beside", lambda t: t.replace("// RMSNorm of", "// (a comment) RMSNorm of") + EXTRA)
    changed = sources(tmp_path / "changed", lambda t: t.replace("/ dim + eps)", "/ dim + 2.f * eps)"))
    with ThreadPoolExecutor() as pool:  # (the script uses processes; the compiles are the same)
        compiled = {d.name: sass_diff.kernels(d, ["rmsnorm.cu"], "sm_90", pool) for d in (base, beside, changed)}
    kept = sass_diff.compare(compiled["base"], compiled["beside"])
    assert kept == {"changed": [], "added": [("rmsnorm.cu", "extra_kernel")], "removed": [],
                    "same": [("rmsnorm.cu", "rmsnorm")]}
    found = sass_diff.compare(compiled["base"], compiled["changed"])
    assert found["changed"] == [("rmsnorm.cu", "rmsnorm")] and not found["same"]


def test_a_cubin_is_read_as_an_elf_image_or_refused():
    import pytest
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF image"):
        sass_diff.text_sections(b"\x7fELF\x01\x01" + bytes(64))


def test_a_revision_without_cuda_src_is_named(capsys):
    assert sass_diff.main(["no-such-revision-anywhere", "--files", "rmsnorm.cu"]) == 2
    assert "no cuda_src/ at 'no-such-revision-anywhere'" in capsys.readouterr().err


def test_timings_compile_both_trees_afresh_and_name_each_files_cost(capsys, monkeypatch, tmp_path):
    import os
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path / "kept"))
    assert sass_diff.main(["HEAD", "--files", "rmsnorm.cu", "--arch", "sm_90", "--timings"]) == 0
    out = capsys.readouterr().out
    line, = [x for x in out.splitlines() if x.startswith("compiles rmsnorm.cu: 1 units, ")]
    assert line.count(" 1 units, ") == 2 and "bytes at HEAD" in line and "bytes in the working tree" in line
    assert os.environ["TILEINFER_CACHE"] == str(tmp_path / "kept")  # put back
    assert not (tmp_path / "kept").exists()  # the compiles went to a cache of their own
