"""scripts/bench_structured.py's and scripts/structured_timeline.py's dry runs on the CPU runner (the tiny
checkpoint): the three runs happen, the constrained ones spend host time in the grammar and the unconstrained
one none, the figures agree; each step's grammar work comes in order."""
import importlib.util
import json
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_measures_all_three_cases(tiny_checkpoint, tmp_path):
    bench = load_script("bench_structured")
    result = bench.main(["--device", "cpu", "--model", str(tiny_checkpoint), "--batch", "4", "--context", "16",
                         "--new", "6", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "bench_structured.json").read_text()) == json.loads(json.dumps(result))
    plain, every, half = result["plain"], result["every"], result["half"]
    assert plain["grammar_ms_per_step"] == 0 and every["grammar_ms_per_step"] > 0 and half["grammar_ms_per_step"] > 0
    for r in (plain, every, half):
        assert r["batch"] == 4 and r["steps"] >= 3
        assert abs(r["decode_tok_s"] * r["ms_per_step"] / 1e3 - 4) < 1e-6  # 4 tokens a step
    assert result["masking_cost_fraction"] == (every["ms_per_step"] - plain["ms_per_step"]) / plain["ms_per_step"]


def test_the_timeline_dry_run_orders_each_steps_grammar_work(tiny_checkpoint, tmp_path):
    timeline = load_script("structured_timeline")
    result = timeline.main(["--device", "cpu", "--model", str(tiny_checkpoint), "--batch", "4", "--context", "16",
                            "--new", "8", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "structured_timeline.json").read_text()) == json.loads(json.dumps(result))
    rows = result["steps"]
    assert len(rows) >= 3
    for r in rows:  # after the tokens are read: consume, then the next step's masks, then its tokens
        assert 0 <= r["consume_start"] <= r["consume_end"] <= r["masks_published"] <= r["next_read_end"]
    assert {"consume", "fill", "publish", "collect", "launch"} <= set(result["per_call_ms"])
    assert set(result["summary"]) >= {"consume_start", "masks_published", "next_read_end", "next_wait"}
