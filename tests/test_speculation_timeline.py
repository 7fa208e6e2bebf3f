"""scripts/speculation_timeline.py on the CPU runner (the demo target and its DFlash drafter, a few tokens): a
round's marks come in the engine's order and in time order."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "speculation_timeline.py"


@pytest.fixture(scope="module")
def timeline():
    spec = importlib.util.spec_from_file_location("speculation_timeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_rounds_marks_come_in_the_engines_order(timeline):
    result = timeline.main(["--device", "cpu", "--tokens", "12", "--passes", "1", "--chats", "2"])
    labels = [label.split("#")[0] for label in result["labels"]]
    order = ["accept>", "accept<", "step<", "step>", "propose>", "propose<", "verify>", "context>", "context<",
             "verify<"]
    assert [label for label in labels if label in order] == order
    assert result["us"] == sorted(result["us"]) and result["rounds"] >= 3 and result["target_steps"] > 0


def test_rounds_are_cut_where_the_verify_step_returns(timeline):
    marks = [("verify<", 1.0), ("a>", 1.5), ("a<", 2.0), ("verify<", 3.0), ("a>", 3.25), ("a<", 3.5), ("verify<", 4.0),
             ("a>", 5.0)]
    rounds = timeline.rounds_of(marks)
    assert rounds == [[("a>", 0.5), ("a<", 1.0), ("verify<", 2.0)], [("a>", 0.25), ("a<", 0.5), ("verify<", 1.0)]]
    labels, times, count = timeline.median_round(rounds)
    assert labels == ["a>#1", "a<#1", "verify<#1"] and times == [0.375, 0.75, 1.5] and count == 2
