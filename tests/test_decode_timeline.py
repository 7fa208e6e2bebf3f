"""scripts/decode_timeline.py's accounting of a run's launches (the GPU's part needs a GPU): which launches are
the decode steps of a batch, the GPU's idle time between two of them, and the lines it prints."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import decode_timeline as dt  # noqa: E402


def marks_of(launches):
    """Marks with events that are times in ms: (start, end, began in ms, rows, decode) a launch."""
    return [dt.Mark(start, end, began / 1e3, 0.2, rows, decode) for start, end, began, rows, decode in launches]


def test_only_consecutive_decode_steps_of_the_batch_are_paired():
    marks = marks_of([
        (0.0, 3.0, 0.0, 4, False),    # the prompts' chunk
        (3.0, 5.0, 1.0, 4, True),     # decode steps of 4 rows, the GPU never idle between them ...
        (5.0, 7.0, 3.0, 4, True),
        (7.5, 9.5, 7.4, 4, True),     # ... but 0.5 ms here: the host launched it after the GPU had finished
        (9.5, 10.0, 9.0, 3, True),    # a smaller batch (a request ended): not one of the steps
        (10.0, 12.0, 9.5, 4, True),   # the only one after it is not a step: no pair
    ])
    s = dt.summarize(marks, 4, lambda a, b: b - a)
    assert s["steps"] == 4
    assert s["step_ms"].tolist() == [2.0, 2.0, 2.0, 2.0]
    assert s["gap_ms"].tolist() == [0.0, 0.5]
    assert s["wall_ms"].tolist() == pytest.approx([2.0, 4.4])
    text = dt.render("m batch 4", 4, s, 1.9, "of a step at the prompts' end", 2.05)
    assert ("ms a step, median over 4 steps); graph replay 1.900 ms of a step at the prompts' end (that step in the "
            "run: 2.050 ms)") in text
    assert "GPU idle between steps: median 250.0 us" in text


def test_a_run_without_two_consecutive_steps_is_named():
    marks = marks_of([(0.0, 3.0, 0.0, 8, False), (3.0, 5.0, 1.0, 8, True)])
    with pytest.raises(ValueError, match="no two consecutive decode steps of 8 rows among 2 launches"):
        dt.summarize(marks, 8, lambda a, b: b - a)


def test_the_offline_accounting_splits_decode_and_prompt_steps():
    marks = marks_of([
        (0.0, 3.0, 0.0, 4, False),    # a prompt step, first: no gap before it
        (3.0, 5.0, 1.0, 4, True),
        (6.0, 9.0, 5.5, 6, False),    # a prompt step the GPU waited 1 ms for
        (9.5, 10.0, 9.0, 6, True),    # a decode step after 0.5 ms idle
    ])
    k = dt.by_kind(marks, lambda a, b: b - a)
    assert k["decode steps"] == dict(steps=2, gpu_s=pytest.approx(0.0025), host_s=pytest.approx(0.0004),
                                     idle_s=pytest.approx(0.0005), largest_idle_ms=0.5)
    assert k["prompt steps"] == dict(steps=2, gpu_s=pytest.approx(0.006), host_s=pytest.approx(0.0004),
                                     idle_s=pytest.approx(0.001), largest_idle_ms=1.0)
