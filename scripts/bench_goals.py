#!/usr/bin/env python3
"""The performance goals' table from one run: every case measured in one process, the peer beside it.

    python3 scripts/bench_goals.py --peer bench/peer_gptfast.py [--profile] [--peer-prewarm] [--out DIR]
        [--cold-model DIR] [--only KEY,...]
    python3 scripts/bench_goals.py --merge A/bench_goals.json B/bench_goals.json [--out DIR]

Cases (H200, bf16 weights, synthetic checkpoints; the same measurements as scripts/bench.py, whose
functions this calls):
  - a fresh machine's first `tileinfer generate` (the demo model, or --cold-model), in a process of its own
    over an empty kernel cache (a temporary TILEINFER_CACHE): seconds until its first token reaches
    stdout, with the kernels it compiled and its GPU runner's log line (the seconds opening the device,
    loading the weights, compiling and loading the kernels, and when); then the same command over the cache
    it filled (0 compiled);
  - batch-1 decode after a 512-token prompt: qwen3-0.6b, qwen3-4b, qwen3-8b, apertus-8b (the peer at batch 1);
  - qwen3-4b batch-1 decode after 32,768 positions, BF16 and INT8 cache (the peer: BF16);
  - qwen3-4b prefill of one 4,096-token prompt, as a fraction of the measured 790 TFLOP/s;
  - qwen3-0.6b engine decode at batch 64 (the peer at batch 64) and the offline benchmark;
  - qwen3-4b engine decode at batch 256 (the peer at batch 256);
  - start-up of that engine (LLM.startup): run after the cases above have compiled every kernel,
    so it is the warm-cache figure the goal names, with the number of kernels it compiled.
Prints the table (case, peer, roofline, goal, measured, met) and writes bench_goals.json and .md to
--out ($OUT by default). A case that fails or times out is reported as not measured; the rest go on.
--only runs the cases of the given keys alone (GOALS' first column, e.g. --only cold_start). --merge measures
nothing: it writes the table, gaps and profiles of earlier runs' bench_goals.json together, where a machine's limit
on one command's time splits a whole run into --only parts run one after another on one machine start.
With --profile, the single-sequence cases (batch-1 decode, 32k, the prefill) and the batch-64 step
also carry their step's per-kernel GPU time (bench.py --profile), and the decode cases what each
kernel group costs inside the decode graph (bench.py --ablate); the .md lists them under the table,
after each unmet decode goal's gap: the step the goal allows against the measured one, and each kernel
group's time against its bytes at 4.3 TB/s (gaps_md): the measured cause of each gap, from the same run.
The offline case's gap splits its seconds into decode steps, steps with prompt chunks and the rest, with the
kernel groups of a decode step shaped like the run's average (offline_gap_md).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# (key, case, goal, how the goal reads, True when larger is better)
GOALS = [
    ("0.6b_b1", "qwen3-0.6b decode, batch 1, 512 positions", 2000, ">= 2,000 tok/s", True),
    ("4b_b1", "qwen3-4b decode, batch 1, 512 positions", 450, ">= 450 tok/s", True),
    ("8b_b1", "qwen3-8b decode, batch 1, 512 positions", 225, ">= 225 tok/s", True),
    ("apertus8b_b1", "apertus-8b decode, batch 1, 512 positions", 240, ">= 240 tok/s", True),
    ("4b_32k_bf16", "qwen3-4b decode, batch 1, 32,768 positions, BF16 cache", 285, ">= 285 tok/s", True),
    ("4b_32k_int8", "qwen3-4b decode, batch 1, 32,768 positions, INT8 cache", 345, ">= 345 tok/s", True),
    ("0.6b_b64", "qwen3-0.6b decode, batch 64, 512 positions, total", 40000, ">= 40,000 tok/s", True),
    ("4b_b256", "qwen3-4b decode, batch 256, 512 positions, total", 32000, ">= 32,000 tok/s", True),
    ("0.6b_offline", "qwen3-0.6b offline, 256 requests, in/out 100-1024", 32000, ">= 32,000 output tok/s", True),
    ("4b_prefill", "qwen3-4b prefill, one 4,096-token prompt", 0.7, ">= 70% of 790 TFLOP/s", True),
    ("startup", "start-up, warm kernel cache: compile + capture", 1.0, "<= 1 s, 0 kernels compiled", False),
    ("cold_start", "`tileinfer generate`, empty kernel cache: to the first token", 10.0,
     "<= 10 s, then 0 compiled", False),
]


def _fmt(x, key: str) -> str:
    if x is None:
        return "-"
    if key == "4b_prefill":
        return f"{100 * x:.1f}%"
    if key in ("startup", "cold_start"):
        return f"{x:.2f} s"
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def goals_table(values: dict) -> str:
    """Markdown table of the goals from `values`: key -> dict(measured=..., peer=..., roofline=...,
    extra=str) or a missing key (not measured). The start-up row also needs extra `compiled` (kernels
    compiled during start-up): its goal holds only with 0. The cold-start row needs `compiled` (the
    compiles of the first run), `warm` (the second run's seconds) and `warm_compiled` (its compiles):
    its goal holds only if the second run compiled nothing."""
    lines = ["| case | peer | roofline | goal | measured | met |", "|---|---|---|---|---|---|"]
    for key, case, goal, reads, larger in GOALS:
        v = values.get(key)
        if not v or v.get("measured") is None:
            lines.append(f"| {case} | - | - | {reads} | not measured | - |")
            continue
        m = v["measured"]
        met = m >= goal if larger else m <= goal
        shown = _fmt(m, key)
        if key == "startup":
            compiled = v.get("compiled")
            met = met and compiled == 0
            shown += f", {compiled} compiled"
        if key == "cold_start":
            met = met and v.get("warm_compiled") == 0
            shown += (f" ({v.get('compiled')} compiles); warm cache {v.get('warm', 0):.2f} s, "
                      f"{v.get('warm_compiled')} compiled")
        if v.get("extra"):
            shown += f" ({v['extra']})"
        lines.append(f"| {case} | {_fmt(v.get('peer'), key)} | {_fmt(v.get('roofline'), key)} | {reads} | {shown} | "
                     f"{'yes' if met else 'no'} |")
    return "\n".join(lines)


# Tokens one decode step of a case makes (the goals are tokens/s): its step time is tokens / rate.
STEP_TOKENS = {"0.6b_b1": 1, "4b_b1": 1, "8b_b1": 1, "apertus8b_b1": 1, "4b_32k_bf16": 1, "4b_32k_int8": 1,
               "0.6b_b64": 64, "4b_b256": 256}
ROOFLINE_TB_S = 4.3  # the measured read bandwidth, as bench.py's roofline


def gaps_md(values: dict) -> str:
    """Each unmet decode goal whose case was ablated (--profile): the step the goal allows against the
    measured one, and each kernel group's time inside the decode graph against its bytes at 4.3 TB/s
    (the weights it reads; the attention group: the cache, `cache_bytes`), the largest excess first:
    which kernels the gap is in and how many TB/s they are short; then the offline case's (offline_gap_md).
    Empty when every such goal is met."""
    parts = []
    for key, case, goal, reads, _ in GOALS:
        v = values.get(key) or {}
        measured, ablation = v.get("measured"), v.get("ablation")
        if key not in STEP_TOKENS or measured is None or measured >= goal or not ablation:
            continue
        n = STEP_TOKENS[key]
        need, wall, gpu = n * 1e6 / goal, n * 1e6 / measured, ablation["step_ms"] * 1e3
        lines = [f"{case}: {_fmt(measured, key)} tok/s, a step of {wall:.0f} us (GPU, without sampling: {gpu:.0f} us); "
                 f"the goal ({reads}) allows {need:.0f} us: {wall - need:.0f} us short. Where the step's time goes:", ""]
        parts.append("\n".join(lines + group_rows_md(ablation, v.get("cache_bytes", 0))) + "\n")
    offline = offline_gap_md(values.get("0.6b_offline") or {})
    return "\n".join(parts + ([offline] if offline else []))


def group_rows_md(ablation: dict, cache_bytes: float) -> list[str]:
    """The table of an ablated step's kernel groups: each one's time against its bytes at 4.3 TB/s
    (the attention group's: the cache), the largest excess first, the rest of the step last but one."""
    gpu = ablation["step_ms"] * 1e3
    rows = [(r["group"], r["us"], r["bytes"] + (cache_bytes if r["group"].startswith("attention") else 0))
            for r in ablation["groups"]]
    rows.append(("other kernels (the step less the groups)", gpu - sum(us for _, us, _ in rows), 0))
    rows = [(group, us, nbytes, nbytes / (ROOFLINE_TB_S * 1e6)) for group, us, nbytes in rows]  # + bound, us
    lines = ["| group | us in the step | its bytes at 4.3 TB/s, us | over that, us | TB/s | short of 4.3 TB/s |",
             "|---|---|---|---|---|---|"]
    for group, us, nbytes, bound in sorted(rows, key=lambda row: row[3] - row[1]):
        tbs = nbytes / (us * 1e6) if nbytes and us > 0 else None
        lines.append(f"| {group} | {us:.0f} | {bound:.0f} | {us - bound:.0f} | "
                     f"{'-' if tbs is None else f'{tbs:.2f}'} | {'-' if tbs is None else f'{ROOFLINE_TB_S - tbs:.2f}'} |")
    return lines


def offline_gap_md(v: dict) -> str:
    """The offline case's gap, when unmet and its run's breakdown is known: the seconds the goal
    allows against the measured ones, split into the iterations that finished decode steps (their rows,
    tokens/s), those that finished steps with prompt chunks, and generate's work outside the steps."""
    r = v.get("run")
    goal = next(g for key, _, g, *_ in GOALS if key == "0.6b_offline")
    if not r or "decode_seconds" not in r or r["output_tok_s"] >= goal:
        return ""
    allowed = r["output_tokens"] / goal
    mean_rows = r["decode_rows"] / max(1, r["decode_steps"])
    decode_rate = r["decode_rows"] / r["decode_seconds"] if r["decode_seconds"] else 0.0
    streamed = ""
    if r.get("decode_bytes") and r["decode_seconds"]:
        tbs = r["decode_bytes"] / r["decode_seconds"] / 1e12
        streamed = (f"; they read {r['decode_bytes'] / 1e9:,.0f} GB (weights each step, the cache each row): "
                    f"{tbs:.2f} TB/s, {ROOFLINE_TB_S - tbs:.2f} short of {ROOFLINE_TB_S}")
    return "\n".join([
        f"qwen3-0.6b offline: {r['output_tokens']:,} output tokens in {r['seconds']:.2f} s "
        f"({r['output_tok_s']:,.0f} tok/s); the goal allows {allowed:.2f} s: {r['seconds'] - allowed:.2f} s short.", "",
        "| part | steps | s | what it did |", "|---|---|---|---|",
        f"| decode steps (one token a row) | {r['decode_steps']:,} | {r['decode_seconds']:.2f} | "
        f"{r['decode_rows']:,} tokens, {mean_rows:.1f} rows a step on average, {decode_rate:,.0f} tok/s{streamed} |",
        f"| steps with prompt chunks | {r['prefill_steps']:,} | {r['prefill_step_seconds']:.2f} | "
        f"{r['prefill_tokens']:,} prompt tokens, plus the decode rows beside them |",
        f"| outside the steps (generate's own work) | - | {r['outside_step_seconds']:.2f} | - |", ""]
        + ([f"A decode step like the run's average ({a['batch']} rows at {a['context']} positions, "
            f"{a['ablation']['step_ms'] * 1e3:.0f} us of GPU time), by kernel group:", "",
            *group_rows_md(a["ablation"], a["cache_bytes"]), ""] if (a := r.get("typical_step")) else []))


def profiles_md(values: dict, top: int = 6) -> str:
    """Each profiled case's `top` slowest kernels (bench.render_profile) and, for the batch-1 decode
    cases, what each kernel group costs inside the decode graph (bench.render_ablation), in GOALS
    order; empty without profiles."""
    from bench import render_ablation, render_profile  # scripts/bench.py
    parts = []
    for key, case, *_ in GOALS:
        v = values.get(key) or {}
        if v.get("profile"):
            parts.append(render_profile(case, v["profile"], "one step, per kernel", top))
        if v.get("ablation"):
            parts.append(render_ablation(case, v["ablation"]))
    return "\n".join(parts)


# The peer's runs in measure(): (model, batch, context), 128 new tokens each, as bench.run_peer calls it.
PEER_RUNS = [("qwen3-0.6b", 1, 512), ("qwen3-4b", 1, 512), ("qwen3-8b", 1, 512), ("apertus-8b", 1, 512),
             ("qwen3-4b", 1, 32768), ("qwen3-0.6b", 64, 512), ("qwen3-4b", 256, 512)]
PEER_NEW = 128


def peer_commands(peer: Path) -> list[list[str]]:
    """The command of each of the peer's runs (bench.run_peer's)."""
    from bench import peer_command  # scripts/bench.py
    return [peer_command(peer, name, context, PEER_NEW, batch) for name, batch, context in PEER_RUNS]


def prewarm_peer(peer: Path, timeout: int) -> float:
    """Run every one of the peer's cases at once, results discarded, so that its torch.compile caches
    (on disk) are warm when measure() runs each case alone: on a fresh machine its compiles, one after
    another, take minutes. Returns the seconds taken."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OUT": os.environ.get("TMPDIR", "/tmp")}  # its JSON files aside
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
             for cmd in peer_commands(peer)]
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
    return time.perf_counter() - start


def first_output(cmd: list[str], env: dict, timeout: float) -> tuple[float, float, str]:
    """Run `cmd`: (seconds until its first byte on stdout, seconds until it exits, its stderr). RuntimeError
    with the end of its stderr when it fails; killed after `timeout` seconds."""
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: progress bars cannot fill it and block the run
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            proc.stdout.read(1)
            first = time.perf_counter() - start
            proc.stdout.read()
            proc.wait()
        finally:
            timer.cancel()
        total = time.perf_counter() - start
        err.seek(0)
        text = err.read().decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with status {proc.returncode} after {total:.1f} s:\n"
                               f"{text[-3000:]}")
    return first, total, text


COLD_PROMPT = "The capital of France is"
COLD_TIMEOUT = 600  # seconds a cold-start run may take before it is killed (and the case not measured)


# `python -m tileinfer` with INFO logging, each record stamped with the milliseconds since logging was imported
# (the interpreter's start, within a few ms): the GPU runner's log line says where its construction's time went.
LOGGED_MAIN = ("import logging, runpy; logging.basicConfig(level=logging.INFO, "
               "format='%(relativeCreated).0f ms %(name)s: %(message)s'); "
               "runpy.run_module('tileinfer', run_name='__main__', alter_sys=True)")
# (Not anchored at a line's start: a line logged while the compiles' progress bar is drawn follows the bar's text.)
RUNNER_LINE = re.compile(r"(\d+) ms tileinfer\.runner\.gpu: GPU runner: (device opened in .*)$", re.M)
COMPILE_LINE = re.compile(r"(\d+) ms tileinfer\.cuda\.compiler: (compiled \d+ kernel units .*)$", re.M)
LOAD_LINE = re.compile(r"(\d+) ms tileinfer\.cuda\.module: (\S+(?: \(part \d+\))?) loaded in [0-9.]+ s, waiting for its "
                       r"compile$", re.M)


def runner_phases(stderr: str) -> str | None:
    """Where a logged run's start went, from its stderr: the GPU runner's line (the device's opening and the weights'
    load) with when it was written, "at N ms: device opened in ..."; then how many files its steps waited for the
    compiles of at their first use (module.LOAD_LOG) and when the last of those waits ended; then the compiler's
    line (start_compiling's: when its compiles ended, how long its child processes took, and NVRTC's share)."""
    found = RUNNER_LINE.search(stderr)
    if not found:
        return None
    text = f"at {int(found[1]):,} ms: {found[2]}"
    waits = LOAD_LINE.findall(stderr)
    if waits:
        at, name = max(waits, key=lambda w: int(w[0]))
        text += f"; {len(waits)} units loaded once their compiles ended, the last {name} at {int(at):,} ms"
    compiled = COMPILE_LINE.search(stderr)
    return text + (f" (its compiles ended at {int(compiled[1]):,} ms: {compiled[2]})" if compiled else "")


def cold_start(model: Path | None, timeout: float, run=first_output) -> dict:
    """`tileinfer generate` (one new token) as a new user's first run: its own process, over an empty kernel
    cache (a temporary TILEINFER_CACHE); then again over the cache the first run filled. Each run's
    seconds to its first output (the token's text; the newline after it when the token prints nothing)
    and to its exit, and the cubins each one added to the cache (its compiles). The runs log at INFO, so
    the first one's GPU runner line (where its construction's time went) is reported too."""
    cmd = [sys.executable, "-c", LOGGED_MAIN, "generate", "--prompt", COLD_PROMPT, "--max-new-tokens", "1",
           *(["--model", str(model)] if model else [])]
    with tempfile.TemporaryDirectory(prefix="tileinfer-cold-") as root:
        env = {**os.environ, "TILEINFER_CACHE": root, "PYTHONUNBUFFERED": "1"}
        kernels = Path(root, "kernels")
        first, total, err = run(cmd, env, timeout)
        compiled = len(list(kernels.glob("*.cubin")))
        warm_first, warm_total, _ = run(cmd, env, timeout)
        warm_compiled = len(list(kernels.glob("*.cubin"))) - compiled
    phases = runner_phases(err)
    return dict(measured=first, compiled=compiled, warm=warm_first, warm_compiled=warm_compiled,
                extra=f"whole command {total:.2f} s, warm {warm_total:.2f} s"
                      + (f"; the first run's GPU runner {phases}" if phases else ""))


def measure(args, runs: list[str] = ()) -> dict:
    """Run every case (or those of the keys in args.only); each failure is printed and leaves its keys
    unmeasured. `runs`: the run's header (bench.run_header), kept with the values as "runs"."""
    import bench  # scripts/bench.py: the benchmark functions (needs a GPU)
    from tileinfer.model.config import preset
    from tileinfer.model.synthetic import cached_checkpoint

    def ns(**kw):
        """bench.py's options: its own defaults (so a new option reaches every case), then this run's."""
        base = vars(bench.parser().parse_args([]))
        base.update(context=512, new=128, repeats=3, prefill="", peer=args.peer, peer_timeout=args.peer_timeout,
                    profile=args.profile, ablate=args.profile)
        return argparse.Namespace(**{**base, **kw})

    def peer_per_seq(row):
        return row["peer"]["decode_tok_s_per_seq"] if row.get("peer") else None

    values: dict = {"runs": list(runs)} if runs else {}

    def case(label, fn, keys):
        if args.only and not set(keys) & set(args.only):
            return
        try:
            fn()
        except Exception:  # noqa: BLE001 (one failing case must not lose the others)
            print(f"{label}: failed\n{traceback.format_exc()}", flush=True)
        # the values so far (without the profiles), and the files, in case a later case runs out of time
        print(f"{label}: {json.dumps({k: {f: x for f, x in v.items() if f not in ('profile', 'ablation')} for k, v in values.items() if k != 'runs'})}",
              flush=True)
        if getattr(args, "out", None) is not None:
            write(args.out, values)

    def cache_bytes(name, context, kv="bf16"):  # what a decode step's attention reads, as bench.py counts it
        return bench.kv_bytes(preset(name), context + ns().new // 2, kv)

    def decode(name, key, **kw):
        row = bench.single(ns(**kw), name, preset(name), cached_checkpoint(name), "bf16")
        values[key] = dict(measured=row["decode_tok_s"], peer=peer_per_seq(row), roofline=row["roofline_tok_s"],
                           profile=row.get("profile"), ablation=row.get("ablation"), cache_bytes=cache_bytes(name, 512))
        if row["prefill"]:
            p = row["prefill"][0]
            runs = bench.prefill_runs(p)
            extra = f"{p['TFLOP_s']:.0f} TFLOP/s" + (f"; prompts back to back: {runs}" if runs else "")
            values["4b_prefill"] = dict(measured=p["matmul_fraction"], extra=extra, profile=p.get("profile"))

    def cold():  # first, while this process holds no GPU memory
        values["cold_start"] = cold_start(args.cold_model, COLD_TIMEOUT)
    case("cold start", cold, ["cold_start"])
    case("qwen3-0.6b batch 1", lambda: decode("qwen3-0.6b", "0.6b_b1"), ["0.6b_b1"])
    case("qwen3-4b batch 1 and prefill", lambda: decode("qwen3-4b", "4b_b1", prefill="4096"), ["4b_b1", "4b_prefill"])
    case("qwen3-8b batch 1", lambda: decode("qwen3-8b", "8b_b1"), ["8b_b1"])
    case("apertus-8b batch 1", lambda: decode("apertus-8b", "apertus8b_b1"), ["apertus8b_b1"])

    def long_context():
        name = "qwen3-4b"
        for kv, key in (("bf16", "4b_32k_bf16"), ("int8", "4b_32k_int8")):
            row = bench.single(ns(context=32768), name, preset(name), cached_checkpoint(name), kv, peer=kv == "bf16")
            values[key] = dict(measured=row["decode_tok_s"], peer=peer_per_seq(row), roofline=row["roofline_tok_s"],
                               profile=row.get("profile"), ablation=row.get("ablation"),
                               cache_bytes=cache_bytes(name, 32768, kv))
        values["4b_32k_int8"]["peer"] = values["4b_32k_bf16"]["peer"]  # the peer has no INT8 cache: its BF16 run
    case("qwen3-4b at 32k", long_context, ["4b_32k_bf16", "4b_32k_int8"])

    def batched(name: str, key: str, batch: int, **kw) -> dict:
        """Engine decode at `batch` (the peer at the same batch): values[key]; returns bench.engine's result."""
        out = bench.engine(ns(batches=str(batch), peer_batches=str(batch), **kw), name, cached_checkpoint(name))
        r = out["batch_decode"][0]
        cfg = preset(name)  # roofline as bench.render counts a step: the weights once + every sequence's cache
        cache = r["batch"] * bench.kv_bytes(cfg, r["context"] + r["new"] // 2)
        step_bytes = bench.weight_bytes(cfg) + cache
        values[key] = dict(measured=r["decode_tok_s"], roofline=r["batch"] * bench.ROOFLINE_BYTES_PER_S / step_bytes,
                           peer=r["peer"]["decode_tok_s_total"] if r.get("peer") else None,
                           profile=r.get("profile"), ablation=r.get("ablation"), cache_bytes=cache)
        return out

    def engine():
        name = "qwen3-0.6b"
        out = batched(name, "0.6b_b64", 64, offline=True)
        cfg = preset(name)
        o = out["offline"]
        if "decode_positions" in o:  # what its decode steps read: the weights each step, the cache each row
            o["decode_bytes"] = o["decode_steps"] * bench.weight_bytes(cfg) + bench.kv_bytes(cfg, o["decode_positions"])
        if o.get("typical_step"):
            t = o["typical_step"]
            t["cache_bytes"] = t["batch"] * bench.kv_bytes(cfg, t["context"])
        values["0.6b_offline"] = dict(measured=o["output_tok_s"], run=o)
        s = out["startup"]
        values["startup"] = dict(measured=s["total"], compiled=s["kernels_compiled"],
                                 extra=f"capture {s['capture']:.2f} s")
    case("qwen3-0.6b engine", engine, ["0.6b_b64", "0.6b_offline", "startup"])
    case("qwen3-4b batch 256", lambda: batched("qwen3-4b", "4b_b256", 256), ["4b_b256"])
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", type=Path, help="path to the peer, bench/peer_gptfast.py (run beside each decode case)")
    ap.add_argument("--peer-timeout", type=int, default=300)
    ap.add_argument("--profile", action="store_true",
                    help="also profile the single-sequence cases' steps per kernel (the cause of each gap)")
    ap.add_argument("--peer-prewarm", action="store_true",
                    help="first run all of the peer's cases at once, untimed, to fill its compile caches")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--cold-model", type=Path,
                    help="the checkpoint of the cold-start case (default: the demo model shipped with the package)")
    ap.add_argument("--only", type=lambda text: text.split(","), default=None,
                    help="run only the cases of these GOALS keys, comma-separated (e.g. cold_start)")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="measure nothing: one table from these runs' bench_goals.json (--only parts of one run)")
    args = ap.parse_args()
    if args.merge:
        if args.only or args.peer or args.profile or args.peer_prewarm:
            ap.error("--merge measures nothing: it takes no --only, --peer, --profile or --peer-prewarm")
        print(write(args.out, merge(args.merge)), flush=True)
        return
    unknown = set(args.only or ()) - {key for key, *_ in GOALS}
    if unknown:
        ap.error(f"--only: unknown keys {sorted(unknown)}; the keys are {', '.join(key for key, *_ in GOALS)}")
    import bench  # scripts/bench.py
    from tileinfer.cuda import get_device
    dev = get_device()
    run = bench.run_header(f"{dev.info.name}, {dev.info.num_sms} SMs")
    print(f"Run: {run}", flush=True)
    if args.peer and args.peer_prewarm:
        print(f"peer compile caches warmed in {prewarm_peer(args.peer, args.peer_timeout):.0f} s (all cases at once, "
              "untimed)", flush=True)
    values = measure(args, [run])
    print(write(args.out, values), flush=True)


def merge(paths: list[Path]) -> dict:
    """The values of several runs' bench_goals.json, for one table, with every run's header ("runs"). A case in
    two of them is refused: which run's figure the table gives would otherwise be an accident of the order."""
    values, source = {}, {}
    for path in paths:
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"bench_goals --merge: cannot read {path}: {e}") from None
        if not isinstance(part, dict):
            raise SystemExit(f"bench_goals --merge: {path} is not a bench_goals.json (a JSON object of cases)")
        for key, value in part.items():
            if key == "runs":  # each part's run header, in the order given
                values.setdefault("runs", []).extend(value)
                continue
            if key in values:
                raise SystemExit(f"bench_goals --merge: {key} is in both {source[key]} and {path}; "
                                 "merge runs of different cases (--only)")
            values[key], source[key] = value, path
    return values


def write(out: Path, values: dict) -> str:
    """Write bench_goals.json and .md (the table, the gaps, the profiles) to `out`; returns the .md text."""
    runs = "\n".join(f"Run: {run}" for run in values.get("runs", []))
    text = "\n\n".join(part for part in (runs, goals_table(values), gaps_md(values), profiles_md(values)) if part)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_goals.json").write_text(json.dumps(values, indent=1))
    (out / "bench_goals.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
