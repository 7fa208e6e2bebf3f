#!/usr/bin/env python3
"""Load test of `tileinfer serve`: many streamed requests, some clients walking away, then three checks.

    python scripts/serve_load.py --model qwen3-0.6b --num-requests 1000 --concurrency 256 --out load.json
    python scripts/serve_load.py --model DIR --device cpu --max-num-seqs 4 --max-context 512 \
        --num-requests 12 --concurrency 4 --prompt-len 8 64 --max-tokens 4 24

It starts `python -m tileinfer serve` on 127.0.0.1 at a free port (--model: a checkpoint directory or a
synthetic preset's name), waits for GET /health, and sends --num-requests streamed completions, at most
--concurrency at once: greedy, ignore_eos, prompts of random token ids (a --shared-fraction of them
opening with one of four shared prefixes, so the prefix cache shares pages), lengths uniform in
--prompt-len and --max-tokens, all seeded. A --disconnect-fraction of the clients close their stream after
a random number of chunks. Then:
  (a) every request not closed early came back whole, its text equal to the offline twin's: after the
      server has stopped (SIGTERM, exit status 0), this process runs the same prompts through
      tileinfer.LLM with the server's settings (LLM.generate, greedy, ignore_eos) and compares exactly;
  (b) once the server is idle (GET /metrics: no request running or waiting) no KV page is held by a
      sequence (tileinfer_kv_pages_used 0): pages the prefix cache keeps are free and reclaimable;
  (c) the server still answers an ordinary request after the load (its text is compared in (a) too).
Prints a summary and writes it as JSON to --out; exit status 1 if a check fails (or a request failed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np


sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts beside this one
import bench_serve  # noqa: E402

NAME = "serve-load"
TOKEN_RANGE = (1000, 20000)  # ordinary text tokens of Qwen3's vocabulary
NUM_PREFIXES = 4
MAX_NUM_SEQS = {"cpu": 8, "cuda": 256}  # tileinfer serve's defaults, passed explicitly to both server and twin


@dataclass(frozen=True, slots=True)
class LoadRequest:
    prompt: list[int]
    max_tokens: int
    close_after: int | None  # close the stream after this many chunks with text (None: read it all)


# ---------------------------------------------------------------------------- the workload
def make_load(rng: np.random.Generator, args) -> list[LoadRequest]:
    prefixes = [rng.integers(*TOKEN_RANGE, args.prefix_len).tolist() for _ in range(NUM_PREFIXES)]
    requests = []
    for _ in range(args.num_requests):
        n = int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1))
        head = prefixes[int(rng.integers(NUM_PREFIXES))][:n - 1] if rng.random() < args.shared_fraction else []
        prompt = head + rng.integers(*TOKEN_RANGE, n - len(head)).tolist()
        m = int(rng.integers(args.max_tokens[0], args.max_tokens[1] + 1))
        close_after = int(rng.integers(1, max(2, m))) if rng.random() < args.disconnect_fraction else None
        requests.append(LoadRequest(prompt, m, close_after))
    return requests


def body(req: LoadRequest, stream: bool = True) -> dict:
    b = bench_serve.completion_body(NAME, bench_serve.RequestSpec(req.prompt, req.max_tokens), temperature=0.0)
    return b if stream else {**b, "stream": False, "stream_options": None}


# ---------------------------------------------------------------------------- the server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m tileinfer serve` on 127.0.0.1 as a child process, its output in a log file.
    Use as a context manager: leaving it kills the process if it still runs."""

    def __init__(self, serve_args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "tileinfer", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                *serve_args]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_healthy(self, timeout: float) -> None:
        """Until GET /health answers 200; RuntimeError with the log's tail if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server's /health did not answer 200 within {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, then its exit status; None (and killed) if it did not exit within `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


# ---------------------------------------------------------------------------- talking to it
async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """GET /metrics: sample name -> value (the unlabelled gauges and counters this script reads)."""
    from prometheus_client.parser import text_string_to_metric_families
    r = await client.get("/metrics", timeout=10)
    r.raise_for_status()
    return {s.name: s.value for family in text_string_to_metric_families(r.text) for s in family.samples
            if not s.labels}


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> tuple[bool, dict[str, float]]:
    """Until no request runs or waits (metrics and /health agree); (reached, the last metrics)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await scrape(client)
        health = (await client.get("/health", timeout=10)).json()
        if m["tileinfer_requests_running"] == 0 and m["tileinfer_requests_waiting"] == 0 and health["requests"] == 0:
            return True, m
        if time.monotonic() > deadline:
            return False, m
        await asyncio.sleep(0.1)


async def after_load_request(client: httpx.AsyncClient, req: LoadRequest) -> tuple[bool, str | None, str]:
    """An ordinary (not streamed) request: (it came back whole, its text, what went wrong)."""
    try:
        r = await client.post("/v1/completions", json=body(req, stream=False), timeout=120)
    except httpx.HTTPError as e:
        return False, None, f"{type(e).__name__}: {e}"
    if r.status_code != 200:
        return False, None, f"HTTP {r.status_code}: {r.text[:200]}"
    out = r.json()
    whole = out["usage"]["completion_tokens"] == req.max_tokens
    return whole, out["choices"][0]["text"], "" if whole else f"usage {out['usage']}"


async def drive(url: str, load: list[LoadRequest], final: LoadRequest, args) -> dict:
    """The load, the idle check and the after-load request, against a healthy server."""
    async with bench_serve.make_client(url, None, args.concurrency) as client:
        before = await scrape(client)
        results, seconds = await bench_serve.run_requests(
            client, [body(r) for r in load], offsets=[0.0] * len(load), max_concurrency=args.concurrency,
            timeout=args.timeout, close_after=[r.close_after for r in load])
        idle, metrics = await wait_idle(client, args.idle_timeout)
        final_ok, final_text, final_error = await after_load_request(client, final)
    generated = metrics["tileinfer_generation_tokens_total"] - before.get("tileinfer_generation_tokens_total", 0)
    return dict(results=results, seconds=seconds, idle=idle, metrics=metrics, generated=generated,
                final_ok=final_ok, final_text=final_text, final_error=final_error)


# ---------------------------------------------------------------------------- the offline twin
def engine_options(args) -> dict:
    """tileinfer.LLM's options: the server's (serve_args) as keyword arguments."""
    return dict(device=args.device, max_num_seqs=args.max_num_seqs, max_context=args.max_context,
                kv_quantize="int8" if args.kv_int8 else None, batch_invariant=args.batch_invariant, progress=False)


def offline_texts(model: Path, args, requests: list[LoadRequest]) -> list[str]:
    from tileinfer import LLM, SamplingParams
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    with LLM(model, **engine_options(args)) as llm:
        return [o.text for o in llm.generate([r.prompt for r in requests], params)]


def mismatch(index: int, req: LoadRequest, served: str, offline: str) -> dict:
    at = next((i for i, (a, b) in enumerate(zip(served, offline)) if a != b), min(len(served), len(offline)))
    return {"request": index, "prompt_len": len(req.prompt), "max_tokens": req.max_tokens, "first_difference": at,
            "served": served[max(0, at - 20):at + 60], "offline": offline[max(0, at - 20):at + 60]}


# ---------------------------------------------------------------------------- the run
def model_dir(name: str) -> Path:
    if Path(name).is_dir():
        return Path(name)
    from tileinfer.model.synthetic import cached_checkpoint
    return cached_checkpoint(name, progress=True)


def serve_args(model: Path, args) -> list[str]:
    extra = (["--kv-int8"] if args.kv_int8 else []) + (["--batch-invariant"] if args.batch_invariant else [])
    return ["--model", str(model), "--device", args.device, "--served-model-name", NAME,
            "--max-num-seqs", str(args.max_num_seqs), "--max-context", str(args.max_context), *extra]


def run(args) -> dict:
    """Serve, load, check idle, stop; then the twins and the checks: the summary."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    load = make_load(rng, args)
    final = LoadRequest(rng.integers(*TOKEN_RANGE, args.prompt_len[0]).tolist(), args.max_tokens[0], None)
    model = model_dir(args.model)
    log_path = args.server_log or Path(tempfile.mkstemp(prefix="serve_load-", suffix=".log")[1])
    with ServerProcess(serve_args(model, args), log_path) as server:
        server.wait_healthy(args.startup_timeout)
        print(f"serve_load: server up at {server.url}; sending {len(load)} requests", file=sys.stderr)
        got = asyncio.run(drive(server.url, load, final, args))
        got["exit_code"] = server.stop(args.stop_timeout)
    summary = judge(model, args, load, final, got)
    return {**summary, "wall_seconds": time.perf_counter() - t0, "server_log": str(log_path)}


def compare_with_twins(model: Path, args, twins: list[LoadRequest], served: list[str], labels: list) -> list[dict]:
    """The served texts that differ from their offline twins' (the server has stopped: this process builds
    the LLM with its settings)."""
    print(f"serve_load: running {len(twins)} offline twins", file=sys.stderr)
    offline = offline_texts(model, args, twins)
    return [mismatch(label, r, s, o) for label, r, s, o in zip(labels, twins, served, offline) if s != o]


def judge(model: Path, args, load: list[LoadRequest], final: LoadRequest, got: dict) -> dict:
    results, m = got["results"], got["metrics"]
    finished = [i for i, r in enumerate(results) if r.ok]
    closed = [i for i, r in enumerate(results) if r.closed_early and r.error is None]
    failed = [i for i, r in enumerate(results) if r.error is not None]
    incomplete = [i for i in finished if results[i].completion_tokens != load[i].max_tokens]
    mismatches = compare_with_twins(model, args, [load[i] for i in finished] + [final],
                                    [results[i].text for i in finished] + [got["final_text"] or ""],
                                    finished + ["after-load"])
    out_tokens = sum(results[i].completion_tokens for i in finished)
    checks = {"no_failed_requests": not failed, "finished_requests_complete": not incomplete,
              "finished_equal_offline": not mismatches, "idle_after_load": got["idle"],
              "no_pages_held": got["idle"] and m["tileinfer_kv_pages_used"] == 0,
              "serves_after_load": got["final_ok"], "server_exit_0": got["exit_code"] == 0}
    return {
        "model": str(model), "device": args.device, "max_num_seqs": args.max_num_seqs,
        "max_context": args.max_context, "kv_int8": args.kv_int8, "batch_invariant": args.batch_invariant, "seed": args.seed,
        "requests": len(load), "concurrency": args.concurrency, "finished": len(finished),
        "disconnected": len(closed), "failed": len(failed),
        "first_errors": [results[i].error for i in failed[:5]], "incomplete": incomplete[:20],
        "mismatches": len(mismatches), "first_mismatches": mismatches[:5],
        "pages_held_after": m["tileinfer_kv_pages_used"], "pages_free_after": m["tileinfer_kv_pages_free"],
        "pages_cached_after": m.get("tileinfer_kv_pages_cached"),
        "after_load_error": got["final_error"] or None, "server_exit_code": got["exit_code"],
        # What the server generated during the load against what every request asked for: less when the
        # disconnected clients' requests were aborted before their end (informative, not a check).
        "generated_tokens": got["generated"], "requested_tokens": sum(r.max_tokens for r in load),
        "load_seconds": got["seconds"], "output_tokens": out_tokens,
        "output_tokens_per_second": out_tokens / got["seconds"],
        "checks": checks, "ok": all(checks.values()),
    }


def format_summary(s: dict) -> str:
    lines = [f"requests {s['requests']} at concurrency {s['concurrency']}: {s['finished']} finished, "
             f"{s['disconnected']} disconnected, {s['failed']} failed",
             f"mismatches against the offline twin: {s['mismatches']} (of {s['finished'] + 1} compared)",
             f"KV pages after the load: {s['pages_held_after']:.0f} held by sequences, {s['pages_free_after']:.0f} "
             f"free ({s['pages_cached_after']:.0f} of them cached)",
             f"the server generated {s['generated_tokens']:,.0f} tokens of the {s['requested_tokens']:,} asked for",
             f"load {s['load_seconds']:.1f} s, {s['output_tokens']:,} output tokens of finished requests, "
             f"{s['output_tokens_per_second']:,.1f} tok/s; wall {s['wall_seconds']:.1f} s",
             "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in s["checks"].items())]
    lines += [f"  error: {e}" for e in s["first_errors"]]
    lines += [f"  mismatch: {json.dumps(x, ensure_ascii=False)}" for x in s["first_mismatches"]]
    if s["after_load_error"]:
        lines.append(f"  after-load request: {s['after_load_error']}")
    if not s["ok"]:
        lines.append(f"  server log: {s['server_log']}")
    return "\n".join(lines)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and the engine options the server and its offline twin share (engine_options, serve_args)."""
    p.add_argument("--model", required=True, help="a checkpoint directory, or a synthetic preset (qwen3-0.6b, tiny)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the server's and the twin's device")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests decoding at once (256 on cuda, 8 on cpu)")
    p.add_argument("--max-context", type=int, default=4096, help="positions of a prompt and its reply (4096)")
    p.add_argument("--kv-int8", action="store_true", help="an INT8 KV cache")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the server and the twin in batch-invariant mode (on the GPU, what makes replies comparable "
                        "token for token across different batches)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=1000, help="streamed requests (1000)")
    p.add_argument("--concurrency", type=int, default=256, help="requests in flight at most (256)")
    p.add_argument("--disconnect-fraction", type=float, default=0.1,
                   help="fraction of clients that close their stream after a random number of chunks (0.1)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 1024), metavar=("MIN", "MAX"),
                   help="prompt tokens, uniform in [MIN, MAX] (16 1024)")
    p.add_argument("--max-tokens", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX"),
                   help="output tokens, uniform in [MIN, MAX] (16 512)")
    p.add_argument("--shared-fraction", type=float, default=0.5,
                   help="fraction of prompts opening with one of four shared prefixes (0.5)")
    p.add_argument("--prefix-len", type=int, default=128, help="tokens of a shared prefix (128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (600)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the server may take to start (600)")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds the server may take to be idle after the load (60)")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds the server may take to exit (60)")
    p.add_argument("--server-log", type=Path, default=None, help="the server's output (default: a temporary file)")
    p.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    args = p.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = MAX_NUM_SEQS[args.device]
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args) -> None:
    for name in ("max_num_seqs", "max_context", "num_requests", "concurrency", "prefix_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("prompt_len", "max_tokens"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')} MIN MAX needs 1 <= MIN <= MAX")
    if args.prompt_len[1] + args.max_tokens[1] > args.max_context:
        p.error(f"the longest request ({args.prompt_len[1]} + {args.max_tokens[1]} tokens) exceeds --max-context "
                f"{args.max_context}")
    for name in ("disconnect_fraction", "shared_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    for name in ("timeout", "startup_timeout", "idle_timeout", "stop_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = run(args)
    except (RuntimeError, ValueError, OSError, httpx.HTTPError) as e:
        print(f"serve_load: error: {e}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
