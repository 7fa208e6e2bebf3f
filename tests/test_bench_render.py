"""scripts/bench.py's host-side parts: its results table and its engine's max_context (the measuring needs a GPU;
these do not)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench  # noqa: E402


def test_engine_rows_name_their_cache_and_count_its_bytes():
    # The same step time reads fewer cache bytes with INT8 (codes + a float32 scale per vector), so
    # its GB/s is lower; a row without "kv" (older results) is BF16.
    common = dict(batch=64, context=512, new=128, decode_tok_s=26000.0, ms_per_step=2.4)
    results = [dict(model="qwen3-0.6b", engine=dict(batch_decode=[dict(common, kv="int8"), dict(common)]))]
    lines = [line for line in bench.render(results, "H200").splitlines() if line.startswith("| qwen3-0.6b")]
    int8, bf16 = ([c.strip() for c in line.strip("|").split("|")] for line in lines)
    assert (int8[1], bf16[1]) == ("INT8", "BF16")
    assert float(int8[6]) < float(bf16[6])
    cfg = bench.preset("qwen3-0.6b")
    positions = 512 + 64
    assert bench.kv_bytes(cfg, positions, "int8") / bench.kv_bytes(cfg, positions) == (128 + 4) / 256


def test_ablation_table_names_the_step_and_divides_by_launches():
    ab = dict(step_ms=4.9, groups=[dict(group="RMSNorm", launches=73, us=146.0, bound_us=0.0, GB_s=None),
                                   dict(group="matrix products", launches=145, us=4000.0, bound_us=3500.0, GB_s=3760.0)])
    text = bench.render_ablation("qwen3-8b, k=4", ab, "verify step")
    assert text.startswith("qwen3-8b, k=4: verify step without sampling 4900 us of GPU time")
    assert "| RMSNorm | 73 | 146.0 | 2.00 | 0.0 | - |" in text
    assert "| matrix products | 145 | 4000.0 | 27.59 | 3500.0 | 3760 |" in text
    assert bench.render_ablation("qwen3-8b", ab).startswith("qwen3-8b: decode step without sampling")


def test_engine_max_context_is_the_runs_own_unless_given_and_refuses_one_too_short():
    assert bench.engine_max_context(512, 128) == 704
    assert bench.engine_max_context(512, 128, 40960) == 40960
    with pytest.raises(SystemExit, match="less than the run needs \\(704"):
        bench.engine_max_context(512, 128, 700)


def test_the_revision_names_the_code_with_or_without_git(tmp_path):
    # A run on a GPU machine without the repository's history names its code by the source hash, which a copy of the
    # same files (laid out as scripts/ab.py's trees are) gives too; an ab.py tree adds its REVISION, a checkout its
    # commit. A changed kernel source changes the hash.
    import os
    import re
    import shutil
    import subprocess

    def code_only(folder, names):  # the sources alone (the demo model's weights are megabytes the hash skips)
        return [n for n in names if n == "__pycache__" or
                (Path(folder, n).is_file() and not n.endswith((".py", ".cu", ".cuh")))]

    root = Path(__file__).resolve().parents[1]
    copy = tmp_path / "tree"
    shutil.copytree(root / "tileinfer", copy / "tileinfer", ignore=code_only)
    shutil.copytree(root / "graphs", copy / "tileinfer" / "graphs", ignore=code_only)
    shutil.copytree(root / "cuda_src", copy / "cuda_src", ignore=code_only)
    env = {k: v for k, v in os.environ.items() if k != "TILEINFER_CUDA_SRC"}
    env.update(PYTHONSAFEPATH="1", PYTHONPATH=f"{copy}{os.pathsep}{root / 'scripts'}")

    def revision():
        done = subprocess.run([sys.executable, "-c", "import bench, tileinfer; print(tileinfer.__file__); "
                               "print(bench.revision())"], env=env, cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        where, rev = done.stdout.split("\n")[:2]
        assert Path(where).is_relative_to(copy)  # the copy's package, not this checkout's
        return rev

    here = bench.source_hash()
    assert len(here) == 12 and f"source {here}" in bench.revision()
    assert revision() == f"source {here}"
    (copy / "REVISION").write_text("main 385661e\n")
    assert revision() == f"tree main 385661e, source {here}"
    kernel = copy / "cuda_src" / "rmsnorm.cu"
    kernel.write_text(kernel.read_text() + "\n// changed\n")
    assert revision() != f"tree main 385661e, source {here}"
    version = re.escape(bench.tileinfer.__version__)
    header = rf"\d{{4}}-\d\d-\d\d \d\d:\d\d UTC; GPU X, driver \S+; tileinfer {version}, "
    assert re.fullmatch(header + re.escape(bench.revision()), bench.run_header("GPU X"))
