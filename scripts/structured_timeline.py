#!/usr/bin/env python3
"""Where a constrained decode step's time goes: timestamps of the engine thread and the grammar thread, step by
step, for a batch whose every request is held to bench_structured.py's JSON schema.

    python scripts/structured_timeline.py                       # qwen3-0.6b on the GPU, batch 64, 512 positions
    python scripts/structured_timeline.py --device cpu --model DIR --batch 4 --context 16 --new 8   # a dry run

The engine and runner methods below are wrapped (in this process only) to record when they start and end, on
which thread: Engine._launch (schedule's rows to a launched step), the runner's collect (reading a step's tokens
back: the host waiting for the device), Grammars._consume_and_check (the matchers advanced by those tokens, on
the grammar thread), the runner's publish_masks (the next step's masks handed over), inside it
StepBuffers.masks_taken (waiting for the device to have taken the previous masks; the GPU runner only) and
Grammars.fill_masks (llguidance computing them). For each step of the steady decode, measured from the moment
its tokens were read back (collect's end), it prints the medians and 90th percentiles of: when the grammar thread
began and ended consuming, when the next step's masks were published, when the next step's tokens were read,
and how long the engine thread launched and waited. A step whose masks are published after the device finished
the step's forward waits for them: compare "masks published" with "next tokens read" minus the wait.
Writes structured_timeline.json (the per-step rows and their summary) to $OUT or --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import batch_decode  # noqa: E402
from bench_structured import params, workload_arguments  # noqa: E402

import tileinfer  # noqa: E402
from tileinfer.engine.engine import Engine  # noqa: E402
from tileinfer.engine.structured import Grammars  # noqa: E402
from tileinfer.model.synthetic import cached_checkpoint  # noqa: E402


class Recorder:
    """(name, start, end, thread) of every call of the wrapped methods, while `on`."""

    def __init__(self):
        self.calls: list[tuple[str, float, float, str]] = []
        self.on = False
        self._lock = threading.Lock()
        self._wrapped: list[tuple[type, str, object]] = []

    def wrap(self, cls, method: str, name: str) -> None:
        inner = getattr(cls, method)
        self._wrapped.append((cls, method, cls.__dict__[method]))
        recorder = self

        def timed(*args, **kwargs):
            if not recorder.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                with recorder._lock:
                    recorder.calls.append((name, start, time.perf_counter(), threading.current_thread().name))
        setattr(cls, method, timed)

    def restore(self) -> None:
        """The wrapped methods as they were."""
        for cls, method, original in reversed(self._wrapped):
            setattr(cls, method, original)
        self._wrapped.clear()


def instrument(recorder: Recorder, runner) -> None:
    recorder.wrap(Engine, "_launch", "launch")
    recorder.wrap(type(runner), "collect", "collect")
    recorder.wrap(type(runner), "publish_masks", "publish")
    recorder.wrap(Grammars, "_consume_and_check", "consume")
    recorder.wrap(Grammars, "fill_masks", "fill")
    steps = getattr(runner, "steps", None)
    if steps is not None and hasattr(steps, "masks_taken"):
        recorder.wrap(type(steps), "masks_taken", "staging_wait")


def step_rows(calls: list) -> list[dict]:
    """Per read-back step t (a collect that returned tokens while the grammar ran): milliseconds from its end to
    the grammar's consume start and end, the next masks' publish end, the next read-back's start and end; and the
    engine thread's launch time and the device wait of the next read-back."""
    by = {}
    for name, start, end, _ in sorted(calls, key=lambda c: c[1]):
        by.setdefault(name, []).append((start, end))
    collects = by.get("collect", [])
    rows = []

    def first_after(name: str, t: float):
        return next(((s, e) for s, e in by.get(name, []) if s >= t), None)

    for (_, c_end), (n_start, n_end) in zip(collects, collects[1:]):
        consume, publish, launch = first_after("consume", c_end), first_after("publish", c_end), first_after("launch", c_end)
        if consume is None or publish is None or publish[1] > n_end:
            continue
        ms = lambda t: 1e3 * (t - c_end)  # noqa: E731
        rows.append(dict(consume_start=ms(consume[0]), consume_end=ms(consume[1]), masks_published=ms(publish[1]),
                         next_read_start=ms(n_start), next_read_end=ms(n_end), next_wait=1e3 * (n_end - n_start),
                         launch=1e3 * (launch[1] - launch[0]) if launch is not None and launch[1] <= n_start else None))
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for key in ("consume_start", "consume_end", "masks_published", "next_read_start", "next_read_end", "next_wait",
                "launch"):
        values = [r[key] for r in rows if r[key] is not None]
        if values:
            out[key] = {"p50": float(np.median(values)), "p90": float(np.percentile(values, 90))}
    return out


def durations(calls: list) -> dict:
    """Each wrapped method's median time per call, ms."""
    out = {}
    for name in sorted({c[0] for c in calls}):
        out[name] = float(np.median([1e3 * (e - s) for n, s, e, _ in calls if n == name]))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(ap)
    args = ap.parse_args(argv)
    if args.new < 4:
        ap.error("--new must be >= 4 (steps to time)")
    path = args.model or cached_checkpoint(args.preset)
    recorder = Recorder()
    with tileinfer.LLM(path, device=args.device, max_num_seqs=args.batch, max_context=args.context + args.new + 64,
                       progress=False) as llm:
        instrument(recorder, llm.runner)
        try:
            batch_decode(llm, args.batch, 16, 4, params(4, [True] * args.batch))  # warm-up: kernels, graphs, lexer
            recorder.on = True
            run = batch_decode(llm, args.batch, args.context, args.new, params(args.new, [True] * args.batch))
            recorder.on = False
        finally:
            recorder.restore()
    rows = step_rows(recorder.calls)
    result = dict(device=args.device, model=args.model.name if args.model else args.preset, batch=args.batch,
                  context=args.context, new=args.new, ms_per_step=run["ms_per_step"], steps=rows,
                  summary=summary(rows), per_call_ms=durations(recorder.calls))
    print(f"every request constrained: {run['ms_per_step']:.3f} ms a step; {len(rows)} steps timed from each step's "
          f"tokens read back (ms, p50 / p90):")
    for key, v in result["summary"].items():
        print(f"  {key:16s} {v['p50']:7.3f} / {v['p90']:7.3f}")
    print("median ms a call: " + ", ".join(f"{k} {v:.3f}" for k, v in result["per_call_ms"].items()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_timeline.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
