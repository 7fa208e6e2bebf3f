#!/usr/bin/env python3
"""Serving benchmark: streamed completions sent over HTTP to a running OpenAI-compatible server.

    tileinfer serve --model DIR --port 8000 &
    python scripts/bench_serve.py --num-prompts 200 --input-len 512 --output-len 128 --range-ratio 0.5 \
        --request-rate 8 --max-concurrency 64 --out serve.json

Each request is a POST /v1/completions with `stream: true`, `ignore_eos: true` and `max_tokens` = its
output length, so it produces exactly that many tokens. Prompts are lists of random token ids drawn from
--token-range (ids the tokenizers of Qwen3 checkpoints hold as ordinary text), of lengths spread uniformly
over [len * (1 - r), len * (1 + r)]; or, with --dataset FILE, a JSON list of {"prompt_len", "output_len"}
or {"prompt": text, "output_len"}. Requests arrive as a Poisson process of --request-rate per second (inf:
all at once), at most --max-concurrency in flight (both may be given), from --client-processes processes.

Per request: the time to first token (TTFT: sending to the first chunk with text), the inter-token
latencies (ITL: gaps between consecutive chunks with text; a chunk may carry several tokens), the time per
output token after the first (TPOT = (e2e - TTFT) / (output tokens - 1), the token count from the final
usage chunk) and the end-to-end latency. Prints a table of throughputs and mean/p50/p90/p99 in ms, writes
it with every request's figures to --out. A failed request (an HTTP error, an error chunk, a broken
connection, --timeout) is counted and its message kept; the run goes on. Exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: its prompt (token ids or text) and its output length."""
    prompt: list[int] | str
    output_len: int


@dataclass(slots=True)
class StreamResult:
    """What one streamed request gave. Times in seconds from sending it; chunk_times: chunks with text."""
    ok: bool = False
    error: str | None = None
    text: str = ""
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    closed_early: bool = False  # the client closed the stream on purpose before [DONE]

    @property
    def itl(self) -> list[float]:
        return np.diff(self.chunk_times).tolist() if len(self.chunk_times) > 1 else []

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


# ---------------------------------------------------------------------------- requests
def spread_lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> list[int]:
    """n integers uniform over [length * (1 - ratio), length * (1 + ratio)], each at least 1."""
    lo = max(1, int(length * (1 - ratio)))
    hi = max(lo, int(length * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, n)]


def random_requests(rng: np.random.Generator, n: int, input_len: int, output_len: int, ratio: float,
                    token_range: tuple[int, int]) -> list[RequestSpec]:
    prompt_lens = spread_lengths(rng, n, input_len, ratio)
    output_lens = spread_lengths(rng, n, output_len, ratio)
    return [RequestSpec(rng.integers(*token_range, p).tolist(), o) for p, o in zip(prompt_lens, output_lens)]


def dataset_requests(path: Path, n: int | None, rng: np.random.Generator,
                     token_range: tuple[int, int]) -> list[RequestSpec]:
    """The first n entries (all by default) of a JSON list of {"prompt_len" or "prompt", "output_len"}."""
    entries = json.loads(path.read_text())
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--dataset {path}: expected a non-empty JSON list of objects")
    if n is not None and n > len(entries):
        raise ValueError(f"--num-prompts {n} but --dataset {path} has only {len(entries)} entries")
    specs = []
    for i, e in enumerate(entries[:n]):
        if not isinstance(e, dict) or not _count(e.get("output_len")) or not (
                _count(e.get("prompt_len")) or (isinstance(e.get("prompt"), str) and e["prompt"])):
            raise ValueError(f"--dataset {path}: entry {i} needs output_len >= 1 and prompt_len >= 1 or a "
                             f"non-empty prompt, got {e!r}")
        prompt = e["prompt"] if "prompt" in e else rng.integers(*token_range, e["prompt_len"]).tolist()
        specs.append(RequestSpec(prompt, e["output_len"]))
    return specs


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def arrival_offsets(rng: np.random.Generator, n: int, request_rate: float) -> list[float]:
    """When each request is sent, in seconds from the start: a Poisson process (exponential gaps), or all
    at 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    return np.cumsum(np.concatenate([[0.0], rng.exponential(1 / request_rate, n - 1)])).tolist()


def completion_body(model: str, spec: RequestSpec, temperature: float) -> dict:
    return {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


# ---------------------------------------------------------------------------- one request
async def stream_completion(client: httpx.AsyncClient, body: dict, timeout: float,
                            close_after: int | None = None) -> StreamResult:
    """POST /v1/completions with a streaming body and read its server-sent events to [DONE], within
    `timeout` seconds; close_after: close the stream after that many chunks with text (a client that
    goes away). Never raises for what the server or the connection does: the result says."""
    result = StreamResult()
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {_error_message(await response.aread())}"
                    return result
                await _read_events(response, result, start, close_after)
    except TimeoutError:
        result.error = (f"no [DONE] within --timeout {timeout} s" if result.e2e is None else
                        f"the stream did not end after [DONE] within --timeout {timeout} s")
    except (httpx.HTTPError, httpx.StreamError) as e:
        result.error = f"{type(e).__name__}: {e}"
    except ValueError as e:  # a data line that is not JSON
        result.error = f"bad event: {e}"
    if result.error is None and not result.closed_early:
        result.ok = True
    return result


async def _read_events(response: httpx.Response, result: StreamResult, start: float, close_after: int | None):
    done = False
    async for line in response.aiter_lines():
        if done or not line.startswith("data:"):
            continue  # blank separators, comments; after [DONE], the body's end
        data = line[len("data:"):].strip()
        now = time.perf_counter() - start
        if data == "[DONE]":
            result.e2e = now
            if result.completion_tokens is None:
                result.error = "the stream ended without a usage chunk"
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            result.error = f"error chunk: {event['error'].get('message', event['error'])}"
            return
        if event.get("usage"):
            result.prompt_tokens = event["usage"]["prompt_tokens"]
            result.completion_tokens = event["usage"]["completion_tokens"]
        text = event["choices"][0]["text"] if event.get("choices") else ""
        if text:
            if result.ttft is None:
                result.ttft = now
            result.chunk_times.append(now)
            result.text += text
            if close_after is not None and len(result.chunk_times) >= close_after:
                result.closed_early = True
                return
    if not done:
        result.error = "the stream ended before [DONE]"


def _error_message(raw: bytes) -> str:
    """OpenAI's {"error": {"message"}} if the body is that, else the body's start."""
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


# ---------------------------------------------------------------------------- many requests
async def run_requests(client: httpx.AsyncClient, bodies: list[dict], *, offsets: list[float],
                       max_concurrency: int | None, timeout: float, close_after: list[int | None] | None = None,
                       start: float | None = None) -> tuple[list[StreamResult], float]:
    """Send every body at its offset (seconds from the start: `start`, a time.perf_counter() value, or now),
    at most max_concurrency in flight; the results in order and the seconds from the start to the last answer."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    close_after = close_after or [None] * len(bodies)
    start = time.perf_counter() if start is None else start

    async def one(i: int) -> StreamResult:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        async with gate:
            return await stream_completion(client, bodies[i], timeout, close_after[i])

    results = await asyncio.gather(*(one(i) for i in range(len(bodies))))
    return list(results), time.perf_counter() - start


def send_requests(base_url: str, api_key: str | None, bodies: list[dict], *, offsets: list[float],
                  max_concurrency: int | None, timeout: float, processes: int = 1) -> tuple[list[StreamResult], float]:
    """run_requests from `processes` client processes (forked; request i from process i % processes, the
    concurrency split between them), all timed from one start (time.perf_counter is the same clock in every
    process); the results in order and the seconds from the start to the last answer. One asyncio process
    reads tens of thousands of streamed chunks a second at most: against a fast server, more processes keep
    the client from being what is measured. Call it outside an event loop."""
    processes = max(1, min(processes, len(bodies), max_concurrency or len(bodies)))
    shares = [list(range(k, len(bodies), processes)) for k in range(processes)]
    limits = [None if max_concurrency is None else max_concurrency // processes + (k < max_concurrency % processes)
              for k in range(processes)]
    jobs = [(base_url, api_key, [bodies[i] for i in share], [offsets[i] for i in share], limit, timeout)
            for share, limit in zip(shares, limits)]
    if processes == 1:
        return _client_process(*jobs[0], time.perf_counter())
    start = time.perf_counter() + FORK_SECONDS  # every process has started by then
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
        parts = list(pool.map(_client_process, *zip(*jobs), [start] * processes))
    results: list[StreamResult] = [None] * len(bodies)  # type: ignore[list-item]
    for share, (part, _) in zip(shares, parts):
        for i, r in zip(share, part):
            results[i] = r
    return results, max(seconds for _, seconds in parts)


FORK_SECONDS = 1.0  # how long after send_requests forks its client processes they start sending


def _client_process(base_url: str, api_key: str | None, bodies: list[dict], offsets: list[float],
                    max_concurrency: int | None, timeout: float, start: float) -> tuple[list[StreamResult], float]:
    """One client's share of send_requests: its results and the seconds from `start` to its last answer."""
    async def run() -> tuple[list[StreamResult], float]:
        async with make_client(base_url, api_key, max_concurrency or len(bodies)) as client:
            return await run_requests(client, bodies, offsets=offsets, max_concurrency=max_concurrency,
                                      timeout=timeout, start=start)
    return asyncio.run(run())


def make_client(base_url: str, api_key: str | None, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(None),
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


async def served_model(client: httpx.AsyncClient) -> dict:
    """The first entry of GET /v1/models: {"id", "max_model_len", ...}."""
    r = await client.get("/v1/models", timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"GET /v1/models answered HTTP {r.status_code}: {_error_message(r.content)}")
    return r.json()["data"][0]


# ---------------------------------------------------------------------------- the report
def stats_ms(seconds: list[float]) -> dict:
    """mean, p50, p90, p99 of `seconds`, in milliseconds (None each when there are none)."""
    if not seconds:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(seconds, dtype=np.float64) * 1000
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(specs: list[RequestSpec], results: list[StreamResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.completion_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    return {
        "successful_requests": len(done), "failed_requests": len(failed),
        "first_error": failed[0].error if failed else None,
        "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "requested_output_tokens": sum(s.output_len for s, r in zip(specs, results) if r.ok),
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": stats_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": stats_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in done]),
        "requests": [_request_row(s, r) for s, r in zip(specs, results)],
    }


def _request_row(spec: RequestSpec, r: StreamResult) -> dict:
    ms = lambda s: None if s is None else s * 1000  # noqa: E731
    return {"output_len": spec.output_len, "prompt_tokens": r.prompt_tokens, "output_tokens": r.completion_tokens,
            "ttft_ms": ms(r.ttft), "tpot_ms": ms(r.tpot), "e2e_ms": ms(r.e2e), "chunks": len(r.chunk_times),
            "error": r.error}


def format_table(report: dict) -> str:
    def num(x, fmt="{:,.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = [f"{'model':<34}{report['model']}",
             f"{'requests (ok / failed)':<34}{report['successful_requests']} / {report['failed_requests']}",
             f"{'duration (s)':<34}{num(report['duration_s'])}",
             f"{'input / output tokens':<34}{report['total_input_tokens']:,} / {report['total_output_tokens']:,}",
             f"{'request throughput (req/s)':<34}{num(report['request_throughput'])}",
             f"{'output throughput (tok/s)':<34}{num(report['output_throughput'])}",
             f"{'total throughput (tok/s)':<34}{num(report['total_token_throughput'])}",
             "", f"{'ms':<10}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = report[f"{name}_ms"]
        lines.append(f"{name.upper():<10}" + "".join(f"{num(s[k]):>12}" for k in ("mean", "p50", "p90", "p99")))
    if report["first_error"]:
        lines += ["", f"first error: {report['first_error']}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the command
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="the model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (default: 100; with --dataset, all its entries)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens, around which they spread (1024)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens, around which they spread (128)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1 (0: all equal)")
    p.add_argument("--token-range", type=int, nargs=2, default=(1000, 20000), metavar=("LO", "HI"),
                   help="random prompt token ids are drawn from [LO, HI) (1000 20000)")
    p.add_argument("--dataset", type=Path, default=None,
                   help='a JSON list of {"prompt_len", "output_len"} or {"prompt": text, "output_len"}')
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (no limit)")
    p.add_argument("--client-processes", type=int, default=1, metavar="N",
                   help="client processes sending the requests (1); one reads tens of thousands of chunks a second "
                        "at most, so a fast server needs more")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take at most (600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths, token ids and arrivals (0)")
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args) -> None:
    for name in ("num_prompts", "max_concurrency", "client_processes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.input_len < 1 or args.output_len < 1:
        p.error("--input-len and --output-len must be >= 1")
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must be in [0, 1)")
    if not 0 <= args.token_range[0] < args.token_range[1]:
        p.error("--token-range LO HI needs 0 <= LO < HI")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if not args.timeout > 0:
        p.error("--timeout must be > 0")


def build_requests(args, rng: np.random.Generator) -> list[RequestSpec]:
    token_range = tuple(args.token_range)
    if args.dataset is not None:
        return dataset_requests(args.dataset, args.num_prompts, rng, token_range)
    return random_requests(rng, args.num_prompts or 100, args.input_len, args.output_len, args.range_ratio,
                           token_range)


def benchmark(args) -> dict:
    rng = np.random.default_rng(args.seed)
    specs = build_requests(args, rng)
    offsets = arrival_offsets(rng, len(specs), args.request_rate)
    served = asyncio.run(_first_model(args.base_url, args.api_key))
    model = args.model or served["id"]
    longest = max((len(s.prompt) if isinstance(s.prompt, list) else 0) + s.output_len for s in specs)
    if "max_model_len" in served and longest > served["max_model_len"]:
        raise ValueError(f"the longest request ({longest} tokens) exceeds the server's max_model_len "
                         f"({served['max_model_len']}); lower --input-len, --output-len or --range-ratio")
    bodies = [completion_body(model, s, args.temperature) for s in specs]
    results, duration = send_requests(args.base_url, args.api_key, bodies, offsets=offsets,
                                      max_concurrency=args.max_concurrency, timeout=args.timeout,
                                      processes=args.client_processes)
    settings = {"base_url": args.base_url, "model": model, "num_prompts": len(specs),
                "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
                "max_concurrency": args.max_concurrency, "client_processes": args.client_processes,
                "temperature": args.temperature, "seed": args.seed}
    return {**settings, **summarize(specs, results, duration)}


async def _first_model(base_url: str, api_key: str | None) -> dict:
    async with make_client(base_url, api_key, 1) as client:
        return await served_model(client)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = benchmark(args)
    except httpx.HTTPError as e:
        print(f"bench_serve: error: cannot reach the server at {args.base_url}: {e}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError, OSError) as e:
        print(f"bench_serve: error: {e}", file=sys.stderr)
        return 1
    print(format_table(report))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 1 if report["failed_requests"] else 0


if __name__ == "__main__":
    sys.exit(main())
