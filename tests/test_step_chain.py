"""scripts/step_chain.py's accounting of a trace (the recording needs a GPU and Nsight Systems): what each kernel
adds to a step's critical path when kernels overlap under programmatic dependent launch, and the steps and layer
positions it sums over, read from an sqlite file laid out as `nsys export --type sqlite` writes it."""
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import step_chain as sc  # noqa: E402


def write_trace(path: Path, kernels: list[tuple[int, int, str]]) -> Path:
    """An sqlite file with nsys's two tables the script reads: kernels (start, end in ns, name) by string id."""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
        db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, shortName INTEGER, "
                   "gridX INTEGER, gridY INTEGER, gridZ INTEGER)")
        ids = {}
        for _, _, name in kernels:
            ids.setdefault(name, len(ids) + 1)
        db.executemany("INSERT INTO StringIds VALUES (?, ?)", [(i, n) for n, i in ids.items()])
        db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, 1, 1, 1)",
                       [(s, e, ids[n]) for s, e, n in kernels])
    return path


def step(t0: int) -> list[tuple[int, int, str]]:
    """One step from t0 (ns): fetch_step, two layers of (qkv, attention, o_proj), the LM head. The attention
    grids start before qkv ends (they wait in pdl_start); the second layer's o_proj ends before its attention."""
    us = 1000
    return [(t0, t0 + 2 * us, "fetch_step"),
            (t0 + 2 * us, t0 + 12 * us, "qkv"), (t0 + 8 * us, t0 + 15 * us, "attention"),
            (t0 + 14 * us, t0 + 20 * us, "o_proj"),
            (t0 + 21 * us, t0 + 30 * us, "qkv"), (t0 + 25 * us, t0 + 36 * us, "attention"),
            (t0 + 26 * us, t0 + 35 * us, "o_proj"),
            (t0 + 36 * us, t0 + 50 * us, "lm_head")]


def test_each_kernel_is_charged_its_end_past_the_kernels_before_it():
    ks = [sc.Kernel(s, e, n, (1, 1, 1)) for s, e, n in step(0)]
    # qkv 10; attention 15 - 12 = 3; o_proj 20 - 15 = 5; a 1 us idle gap, uncharged; qkv 30 - 21 = 9;
    # attention 36 - 30 = 6; o_proj ends before it: 0; the LM head 14.
    assert sc.charges(ks) == [2.0, 10.0, 3.0, 5.0, 9.0, 6.0, 0.0, 14.0]
    assert sum(sc.charges(ks)) == (ks[-1].end - ks[0].start) / 1000 - 1.0


def test_steps_names_and_layer_positions(tmp_path):
    kernels = [(0, 500, "prefill")] + step(1_000) + step(60_000) + step(120_000)
    trace = write_trace(tmp_path / "run.sqlite", kernels)
    steps = sc.decode_steps(sc.read_kernels(trace), "fetch_step", 5)
    assert [len(s) for s in steps] == [8, 8]  # the last step has no fetch_step after it: not whole
    table = dict((name, (launches, us)) for name, launches, us in sc.by_name(steps))
    assert table == {"lm_head": (1, 14.0), "qkv": (2, 19.0), "attention": (2, 9.0), "o_proj": (2, 5.0),
                     "fetch_step": (1, 2.0)}
    # 8 kernels: fetch_step, 2 layers of 3, the LM head; with 3 a layer there are 2 layers and no middle one.
    assert sc.by_layer_position(steps, 3) == []
    steps4 = [[s[0]] + s[1:4] * 4 + [s[-1]] for s in steps]  # four identical layers: the middle two count
    assert [name for name, _ in sc.by_layer_position(steps4, 3)] == ["qkv", "attention", "o_proj"]


def test_a_trace_without_a_whole_step_is_named(tmp_path):
    trace = write_trace(tmp_path / "run.sqlite", step(0))
    with pytest.raises(SystemExit, match="fewer than two 'fetch_step' launches"):
        sc.decode_steps(sc.read_kernels(trace), "fetch_step", 20)


def test_the_command_prints_both_tables(tmp_path):
    trace = write_trace(tmp_path / "run.sqlite", step(0) + step(60_000) + step(120_000))
    out = subprocess.run([sys.executable, str(SCRIPTS / "step_chain.py"), str(trace), "--layer-kernels", "3"],
                         capture_output=True, text=True, check=True).stdout
    assert "2 steps of 8 kernels: median 50.0 us" in out
    assert "| qkv | 2 | 19.0 | 9.50 |" in out
    assert "| position in a layer | kernel | median us on the critical path |" in out
