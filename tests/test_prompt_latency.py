"""scripts/prompt_latency.py on the CPU runner: a row per model and length, medians of positive times, the JSON."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("prompt_latency", ROOT / "scripts" / "prompt_latency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_row_per_length_with_the_engines_first_token_inside_generates_time(tiny_checkpoint, tmp_path, capsys):
    script = load_script()
    out = tmp_path / "rows.json"
    assert script.main(["--models", str(tiny_checkpoint), "--lengths", "3,20", "--repeats", "2", "--device", "cpu",
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in rows] == [3, 20]
    for r in rows:
        assert 0 < r["first_token_ms"] <= r["generate_ms"]
    assert capsys.readouterr().out.count(" alone: generate ") == 2


def test_bad_lengths_are_refused():
    with pytest.raises(SystemExit):
        load_script().main(["--lengths", "0,5", "--device", "cpu"])
