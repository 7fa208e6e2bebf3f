#!/usr/bin/env python3
"""The server's two goals from one run: `tileinfer serve` against `LLM.generate` on the same requests.

    python3 scripts/serve_goals.py --model qwen3-0.6b --num-requests 1024 --input-len 256 --output-len 256
    python3 scripts/serve_goals.py --model DIR --device cpu --max-num-seqs 4 --num-requests 8 --input-len 16 \
        --output-len 8 --ttft-requests 3 --ttft-input-len 32 --ttft-output-len 4

--model is a checkpoint directory or a synthetic preset's name. The requests are random token-id prompts of
--input-len tokens, each generating exactly --output-len tokens (greedy, ignore_eos), seeded. In order:
  1. offline: tileinfer.LLM with the engine options below runs a warm-up, then all --num-requests in one
     LLM.generate (output tokens over its wall time), then each of --ttft-requests prompts of
     --ttft-input-len tokens alone (--ttft-output-len tokens each): the engine's own time to the first
     token (RequestOutput.time_to_first_token: the request made to its first token on the host), i.e. the
     prefill time. The LLM is closed.
  2. served: `python -m tileinfer serve` with the same options (scripts/serve_load.py's ServerProcess) gets
     a warm-up, then the same requests all at once from --client-processes processes (bench_serve.py's
     streaming client): output tokens from the first send to the last answer; then the TTFT prompts one at a
     time: sending to the first chunk with text, as bench_serve.py measures it; and from the server's /metrics
     before and after them, two means over them that split the served TTFT: its engine's own time to first
     token (a request's arrival in the engine process to its first token) and the server's (the request's
     arrival at the app to its first chunk handed to the connection: the engine's, the pipes between the two
     processes and the handler); the rest is HTTP and the client. The server stops (SIGTERM).
Goals: served output tokens/s >= 90% of offline; the median TTFT at low load within 5 ms of the median
prefill time. The warm-ups use prompts of their own, so no measured request finds its prompt in the prefix
cache. Prints a table and writes the figures as JSON to --out ($OUT/serve_goals.json by default).
Exit status 1 if a request failed or came back short, or the server did not exit 0; an unmet goal is a
result, not a failure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np


sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts beside this one
import serve_load  # noqa: E402
bench_serve = serve_load.bench_serve

THROUGHPUT_GOAL = 0.90  # served output tokens/s over offline's
TTFT_GOAL_MS = 5.0      # median TTFT at low load minus the median prefill time
WARMUP_REQUESTS = 16


@dataclass(frozen=True)
class Workload:
    requests: list          # [RequestSpec]: the throughput requests, offline and served
    warmup: list            # their warm-up, prompts of their own
    ttft: list              # the low-load requests
    ttft_warmup: list


def make_workload(args) -> Workload:
    rng = np.random.default_rng(args.seed)
    token_range = serve_load.TOKEN_RANGE

    def specs(n: int, input_len: int, output_len: int) -> list:
        return bench_serve.random_requests(rng, n, input_len, output_len, 0.0, token_range)
    return Workload(requests=specs(args.num_requests, args.input_len, args.output_len),
                    warmup=specs(min(WARMUP_REQUESTS, args.num_requests), args.input_len, args.output_len),
                    ttft=specs(args.ttft_requests, args.ttft_input_len, args.ttft_output_len),
                    ttft_warmup=specs(1, args.ttft_input_len, args.ttft_output_len))


# ---------------------------------------------------------------------------- offline
def offline(model: Path, args, work: Workload) -> dict:
    from tileinfer import LLM, SamplingParams

    def params(specs) -> list:
        return [SamplingParams(max_tokens=s.output_len, temperature=0, ignore_eos=True) for s in specs]

    def run(llm, specs) -> list:
        return llm.generate([s.prompt for s in specs], params(specs))

    print(f"serve_goals: offline, {len(work.requests)} requests", file=sys.stderr)
    with LLM(model, **serve_load.engine_options(args)) as llm:
        run(llm, work.warmup)
        start = time.perf_counter()
        outs = run(llm, work.requests)
        seconds = time.perf_counter() - start
        run(llm, work.ttft_warmup)
        ttft = [run(llm, [s])[0].time_to_first_token for s in work.ttft]
    short = [i for i, (o, s) in enumerate(zip(outs, work.requests)) if len(o.token_ids) != s.output_len]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "output_throughput": tokens / seconds, "short": short[:20],
            "prefill_ms": bench_serve.stats_ms(ttft)}


# ---------------------------------------------------------------------------- served
def served(model: Path, args, work: Workload) -> dict:
    log_path = args.server_log or Path(tempfile.mkstemp(prefix="serve_goals-", suffix=".log")[1])
    with serve_load.ServerProcess(serve_load.serve_args(model, args), log_path) as server:
        server.wait_healthy(args.startup_timeout)
        print(f"serve_goals: server up at {server.url}; {len(work.requests)} requests", file=sys.stderr)
        send(server.url, work.warmup, args, None, 1)
        saturation = send(server.url, work.requests, args, None, args.client_processes)
        send(server.url, work.ttft_warmup, args, 1, 1)
        before = first_token_times(server.url)
        low_load = send(server.url, work.ttft, args, 1, 1)
        after = first_token_times(server.url)
        exit_code = server.stop(args.stop_timeout)
    for key, name in (("engine_ttft_mean_ms", "engine"), ("server_ttft_mean_ms", "http")):
        seconds, requests = (after[f"{name}_{part}"] - before[f"{name}_{part}"] for part in ("sum", "count"))
        low_load[key] = seconds / requests * 1000 if requests else None
    return {"saturation": saturation, "low_load": low_load, "server_exit_code": exit_code, "server_log": str(log_path)}


def first_token_times(url: str) -> dict[str, float]:
    """The server's two histograms of first-token times, GET /metrics, as {engine,http}_{sum,count} (seconds and
    requests so far): its engine's (a request's arrival in the engine process to its first token; every request
    ended) and its own (a streamed request's arrival at the app to its first chunk handed to the connection)."""
    async def read() -> dict[str, float]:
        async with httpx.AsyncClient(base_url=url) as client:
            return await serve_load.scrape(client)
    metrics = asyncio.run(read())
    names = {"engine": "tileinfer_time_to_first_token_seconds", "http": "tileinfer_http_time_to_first_token_seconds"}
    return {f"{key}_{part}": metrics[f"{name}_{part}"] for key, name in names.items() for part in ("sum", "count")}


def send(url: str, specs: list, args, max_concurrency: int | None, processes: int) -> dict:
    """The requests, all sent at once (at most max_concurrency in flight): bench_serve's report without its
    per-request rows, and the requests that failed or came back short."""
    bodies = [bench_serve.completion_body(serve_load.NAME, s, temperature=0.0) for s in specs]
    results, seconds = bench_serve.send_requests(url, None, bodies, offsets=[0.0] * len(bodies),
                                                 max_concurrency=max_concurrency, timeout=args.timeout,
                                                 processes=processes)
    report = bench_serve.summarize(specs, results, seconds)
    del report["requests"]
    report["short"] = [i for i, (r, s) in enumerate(zip(results, specs))
                       if r.ok and r.completion_tokens != s.output_len][:20]
    return report


# ---------------------------------------------------------------------------- the goals
def judge(args, off: dict, on: dict) -> dict:
    sat, low = on["saturation"], on["low_load"]
    ratio = sat["output_throughput"] / off["output_throughput"]
    ttft, prefill = low["ttft_ms"]["p50"], off["prefill_ms"]["p50"]
    ttft_over = None if ttft is None else ttft - prefill
    checks = {"offline_complete": not off["short"],
              "served_all_ok": sat["failed_requests"] == 0 and low["failed_requests"] == 0,
              "served_complete": not sat["short"] and not low["short"],
              "server_exit_0": on["server_exit_code"] == 0}
    goals = {"throughput": ratio >= THROUGHPUT_GOAL, "ttft": ttft_over is not None and ttft_over <= TTFT_GOAL_MS}
    settings = {k: getattr(args, k) for k in ("device", "max_num_seqs", "max_context", "kv_int8", "batch_invariant",
                                              "num_requests", "input_len", "output_len", "ttft_requests",
                                              "ttft_input_len", "ttft_output_len", "client_processes", "seed")}
    return {"model": str(args.model), **settings, "offline": off, "served": on,
            "throughput_ratio": ratio, "ttft_over_prefill_ms": ttft_over, "goals": goals, "checks": checks,
            "ok": all(checks.values())}


def format_table(s: dict) -> str:
    off, sat, low = s["offline"], s["served"]["saturation"], s["served"]["low_load"]
    over = s["ttft_over_prefill_ms"]
    met = {k: "yes" if v else "no" for k, v in s["goals"].items()}
    rows = [f"| output tok/s at saturation: {s['num_requests']} requests, {s['input_len']} in / {s['output_len']} "
            f"out, all at once | >= {THROUGHPUT_GOAL:.0%} of offline | {off['output_throughput']:,.0f} | "
            f"{sat['output_throughput']:,.0f} | {s['throughput_ratio']:.1%} | {met['throughput']} |",
            f"| time to first token at low load: {s['ttft_requests']} prompts of {s['ttft_input_len']} tokens, one "
            f"at a time, median ms | <= prefill + {TTFT_GOAL_MS:g} ms | {off['prefill_ms']['p50']:.2f} (prefill) | "
            f"{'-' if low['ttft_ms']['p50'] is None else format(low['ttft_ms']['p50'], '.2f')} | "
            f"{'-' if over is None else format(over, '+.2f')} ms | {met['ttft']} |"]
    lines = [f"{s['model']} on {s['device']}: max_num_seqs {s['max_num_seqs']}, max_context {s['max_context']}"
             f"{', INT8 cache' if s['kv_int8'] else ''}{', batch-invariant' if s['batch_invariant'] else ''}; "
             f"{s['client_processes']} client processes at saturation",
             "", "| case | goal | offline | served | result | met |", "|---|---|---|---|---|---|", *rows, "",
             f"served at saturation: TTFT p50 {_ms(sat['ttft_ms']['p50'])}, TPOT p50 {_ms(sat['tpot_ms']['p50'])}, "
             f"{sat['duration_s']:.2f} s; offline {off['seconds']:.2f} s",
             "checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in s["checks"].items())]
    engine, server, client = low["engine_ttft_mean_ms"], low["server_ttft_mean_ms"], low["ttft_ms"]["mean"]
    if engine is not None and server is not None and client is not None:
        lines.append(f"low load, means: the offline prefill {off['prefill_ms']['mean']:.2f} ms; in the server the "
                     f"engine's own {engine:.2f} ms (arrival in the engine process to the first token, /metrics); "
                     f"the server's {server:.2f} ms (the request's arrival at the app to its first chunk: the pipes "
                     f"and the handler {server - engine:+.2f} ms); at the client {client:.2f} ms (HTTP and the "
                     f"client {client - server:+.2f} ms)")
    for name, report in (("saturation", sat), ("low load", low)):
        if report["first_error"]:
            lines.append(f"  {name}: first error: {report['first_error']}")
    if not s["ok"]:
        lines.append(f"  server log: {s['served']['server_log']}")
    return "\n".join(lines)


def _ms(x) -> str:
    return "-" if x is None else f"{x:.2f} ms"


# ---------------------------------------------------------------------------- the command
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    serve_load.add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=1024, help="throughput requests (1024)")
    p.add_argument("--input-len", type=int, default=256, help="their prompt tokens (256)")
    p.add_argument("--output-len", type=int, default=256, help="their output tokens (256)")
    p.add_argument("--ttft-requests", type=int, default=32, help="low-load requests, one at a time (32)")
    p.add_argument("--ttft-input-len", type=int, default=512, help="their prompt tokens (512)")
    p.add_argument("--ttft-output-len", type=int, default=16, help="their output tokens (16)")
    p.add_argument("--client-processes", type=int, default=8,
                   help="client processes sending the throughput requests (8; bench_serve.py --client-processes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (600)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the server may take to start (600)")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds the server may take to exit (60)")
    p.add_argument("--server-log", type=Path, default=None, help="the server's output (default: a temporary file)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "serve_goals.json",
                   help="the JSON written ($OUT/serve_goals.json)")
    args = p.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = serve_load.MAX_NUM_SEQS[args.device]
    for name in ("max_num_seqs", "max_context", "num_requests", "input_len", "output_len", "ttft_requests",
                 "ttft_input_len", "ttft_output_len", "client_processes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    longest = max(args.input_len + args.output_len, args.ttft_input_len + args.ttft_output_len)
    if longest > args.max_context:
        p.error(f"the longest request ({longest} tokens) exceeds --max-context {args.max_context}")
    for name in ("timeout", "startup_timeout", "stop_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = make_workload(args)
    try:
        model = serve_load.model_dir(args.model)
        summary = judge(args, offline(model, args, work), served(model, args, work))
    except (RuntimeError, ValueError, OSError, httpx.HTTPError) as e:
        print(f"serve_goals: error: {e}", file=sys.stderr)
        return 1
    print(format_table(summary))
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
