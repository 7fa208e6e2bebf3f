"""scripts/ab.py: revisions prepared from git, and trees run in turns, each importing its own package."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_ab():
    spec = importlib.util.spec_from_file_location("ab", ROOT / "scripts" / "ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_figures_from_benchmark_lines():
    ab = load_ab()
    text = "\n".join([
        "GPU: NVIDIA H200, 132 SMs; tileinfer 0.1.0",
        "qwen3-0.6b: batch 64 decode 30,677 tok/s in total (2,598 GB/s)",
        "qwen3-0.6b: offline 26454 output tok/s (256 requests, 5.6 s)",
        "qwen3-4b: prefill 4096 tokens 61234 tok/s (557.3 TFLOP/s)",
        "qwen3-0.6b: batch 64 decode 30,600 tok/s in total",
        "| model | prompt tokens | prefill tok/s | TFLOP/s | % of 790 TFLOP/s |",
    ])
    found = ab.figures(text, ab.UNITS)
    assert found == [("qwen3-0.6b: batch 64 decode", 30677.0), ("qwen3-0.6b: offline", 26454.0),
                     ("qwen3-4b: prefill 4096 tokens", 61234.0), ("qwen3-0.6b: batch 64 decode", 30600.0)]
    keys = ab.keyed(found)
    assert keys[("qwen3-0.6b: batch 64 decode", 1)] == 30600.0
    assert ab.figures("prefill 557.3 TFLOP/s", ("TFLOP/s",)) == [("prefill", 557.3)]


def test_attention_bench_rows_are_figures():
    # scripts/bench_attention.py's rows, as the lines it prints after its tables, are figures ab.py compares, under a
    # label that does not change from run to run (the time comes after the figure).
    ab = load_ab()
    spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "scripts" / "bench_attention.py")
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "scripts"))  # its neighbour graph_timing
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    prefill = dict(model="qwen3-4b", prompt=4096, us=277.1, flops=1.0, tflop_s=496.2, peak_fraction=0.628)
    decode = dict(model="qwen3-4b", dtype="bf16", batch=1, context=32768, splits=32, us=35.6, bytes=1, gb_s=3765.4,
                  roofline_fraction=0.876)
    text = "\n".join([bench.figure_line(prefill), bench.figure_line(decode)])
    assert ab.figures(text, ab.UNITS) == [("prefill attention, qwen3-4b, 4096-token prompt:", 496.0),
                                          ("decode attention, qwen3-4b bf16, batch 1, 32768 positions, 32 splits:",
                                           3765.0)]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_prepare_writes_a_revision_without_the_demo_weights(tmp_path, monkeypatch):
    ab = load_ab()
    monkeypatch.setattr(ab, "TREES", tmp_path)
    ab.prepare(["HEAD"])
    tree = tmp_path / "HEAD"
    head = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:cuda_src/gemm_swap.cu"], capture_output=True,
                          text=True, check=True).stdout
    assert (tree / "cuda_src" / "gemm_swap.cu").read_text() == head
    assert (tree / "tests" / "gpu" / "test_kernels.py").exists() and (tree / "pyproject.toml").exists()
    assert (tree / "scripts" / "bench.py").exists()
    assert all(p.suffix == ".py" for p in (tree / "tileinfer" / "demo").iterdir())
    assert (tree / "REVISION").read_text().startswith("HEAD ")
    # The tree is the package as installed: tileinfer.graphs and the kernels' sources come from it.
    code = ("import tileinfer.graphs, tileinfer.cuda.compiler as c; "
            "print(tileinfer.graphs.__file__); print(c.cuda_src_dir())")
    r = subprocess.run([sys.executable, "-c", code], env=ab.tree_env("HEAD"), cwd=ROOT, capture_output=True,
                       text=True, check=True)
    graphs, src = r.stdout.split()
    assert Path(graphs).resolve() == (tree / "tileinfer" / "graphs" / "__init__.py").resolve()
    assert Path(src).resolve() == (tree / "cuda_src").resolve()


def fake_tree(trees: Path, name: str, rate: float, check_ok: bool) -> None:
    pkg = trees / name / "tileinfer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"RATE = {rate}\nCHECK_OK = {check_ok}\n")


def test_run_alternates_trees_each_with_its_own_package(tmp_path, monkeypatch, capsys):
    ab = load_ab()
    monkeypatch.setattr(ab, "TREES", tmp_path / "trees")
    for name, rate, ok in (("old", 100.0, True), ("new", 110.0, True), ("broken", 1.0, False)):
        fake_tree(tmp_path / "trees", name, rate, ok)
    py = sys.executable
    args = ab.argparse.Namespace(
        trees="old,new,broken", repeats=2, units="|".join(ab.UNITS), timeout=60.0, logs=str(tmp_path / "logs"),
        check=f"{py} -c 'import sys, tileinfer; sys.exit(0 if tileinfer.CHECK_OK else 1)'",
        cmd=[f"{py} -c 'import tileinfer; print(f\"case a: {{tileinfer.RATE:,.0f}} tok/s\")'",
             f"{py} -c 'import tileinfer; print(f\"case b {{2 * tileinfer.RATE}} GB/s\")'"])
    assert ab.run(args) == 0
    out = capsys.readouterr().out
    assert "left out of the timing (check failed): broken" in out
    order = [line.split()[2] for line in out.splitlines() if line.startswith("round ") and "command 1" in line]
    assert order == ["old", "new", "new", "old"]
    assert "| case a: | 100.0 and 100.0 | 110.0 and 110.0 | +10.0% |" in out
    assert "| case b | 200.0 and 200.0 | 220.0 and 220.0 | +10.0% |" in out
    assert (tmp_path / "logs" / "new_r2_c1.log").read_text().strip() == "case a: 110 tok/s"


def test_run_refuses_a_tree_that_imports_another_package(tmp_path, monkeypatch):
    ab = load_ab()
    monkeypatch.setattr(ab, "TREES", tmp_path / "trees")
    (tmp_path / "trees" / "empty").mkdir(parents=True)  # no tileinfer of its own: the checkout's would be imported
    args = ab.argparse.Namespace(trees="empty", repeats=1, units="tok/s", timeout=60.0, logs=str(tmp_path / "logs"),
                                 check=None, cmd=["true"])
    with pytest.raises(SystemExit, match="tileinfer imports from"):
        ab.run(args)
