"""scripts/compile_timeline.py: each round compiles the units it names over an empty kernel cache (the salted round
a copy of cuda_src/ no compile has seen) and prints the machine's uptime with the compiler's line."""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import compile_timeline as ct  # noqa: E402
from tileinfer.cuda import compiler  # noqa: E402


def test_each_round_compiles_over_an_empty_cache_and_prints_the_compiler_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TILEINFER_CACHE", str(tmp_path / "untouched"))  # restored after the rounds set their own
    monkeypatch.setenv("TILEINFER_CUDA_SRC", str(compiler.cuda_src_dir()))
    monkeypatch.setattr(compiler, "_memory_cache", {})
    monkeypatch.setattr(compiler, "STATS", compiler.CompileStats())
    for salt in ([], ["--salt"]):
        ct.main(["--seconds", "0", "--files", "rmsnorm.cu", *salt])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    for line in lines:
        assert re.match(r"uptime [0-9.]+ s, steal [0-9.]+ s: compiled 1 kernel units in [0-9.]+ s on \d+ cores: "
                        r"their processes took [0-9.]+ s summed \(CPU", line), line
    assert compiler.STATS.compiled == 2, "a round found a cache that was not empty"
    assert not (tmp_path / "untouched").exists()
