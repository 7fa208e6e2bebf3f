"""scripts/bench_tp.py as a dry run on the CPU (one rank): the preset's config-only directory written, the model
loaded with dummy weights, a batch decoded, the table and JSON written. Tensor parallelism itself needs GPUs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_tp.py"


def test_bench_tp_runs_on_the_cpu(tmp_path):
    env = dict(os.environ, TILEINFER_CHECKPOINTS=str(tmp_path / "ckpt"))
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--tp", "1", "--batches", "1,2",
                           "--context", "8", "--new", "6", "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ckpt" / "tiny-config" / "config.json").is_file()
    rows = json.loads((tmp_path / "bench_tp.json").read_text())["rows"]
    assert [(r["tp"], r["batch"]) for r in rows] == [(1, 1), (1, 2)]
    assert all(r["tok_s"] > 0 and 0 < r["of_roofline"] for r in rows)
    assert "| TP 1 | 2 |" in done.stdout and "1.00x" in done.stdout
