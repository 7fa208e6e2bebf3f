"""scripts/bench_serve.py and scripts/serve_load.py against a real `tileinfer serve` process on the CPU runner
(the tiny checkpoint, 127.0.0.1; or a GPU: tests/conftest.py's --serve-device): the benchmark's report adds
up, and the load test's three checks pass. The server stops on SIGTERM with exit status 0."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
KEY = "sk-bench-key"
MAX_NUM_SEQS, MAX_CONTEXT = 4, 512


def load(name: str):
    """A script as a module, loaded once (serve_load.py finds bench_serve under its own name)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.fixture(scope="module")
def server(serve_target, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench-serve") / "server.log"
    options = serve_target.serve_options(MAX_NUM_SEQS, MAX_CONTEXT)
    with load("serve_load").ServerProcess(["--model", str(serve_target.checkpoint), "--api-key", KEY, *options],
                                          log) as s:
        s.wait_healthy(serve_target.startup_seconds)
        yield s
        code = s.stop(30)
        assert code == 0, f"the server's exit status after SIGTERM was {code}:\n{s.log_tail()}"


def bench(server, tmp_path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    rc = load("bench_serve").main(["--base-url", server.url, "--api-key", KEY, "--seed", "3", "--timeout", "30",
                                   "--out", str(out), *argv])
    return rc, json.loads(out.read_text())


def assert_ordered(report: dict) -> None:
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[name]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (name, s)
        assert s["mean"] > 0, (name, s)


def test_bench_reports_every_request_and_ordered_percentiles(server, tmp_path, serve_target):
    rc, r = bench(server, tmp_path, "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                  "--range-ratio", "0.5")
    assert rc == 0 and r["successful_requests"] == 6 and r["failed_requests"] == 0, r["first_error"]
    rows = r["requests"]
    assert all(8 <= q["prompt_tokens"] <= 24 and 4 <= q["output_len"] <= 12 for q in rows), rows
    assert [q["output_tokens"] for q in rows] == [q["output_len"] for q in rows]  # ignore_eos: exactly max_tokens
    assert r["total_output_tokens"] == r["requested_output_tokens"] == sum(q["output_len"] for q in rows)
    assert r["total_input_tokens"] == sum(q["prompt_tokens"] for q in rows)
    assert all(0 < q["ttft_ms"] <= q["e2e_ms"] for q in rows)
    assert_ordered(r)
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0
    assert r["total_token_throughput"] > r["output_throughput"]
    assert r["model"] == serve_target.checkpoint.name  # the first of /v1/models: the checkpoint folder's name


def test_bench_of_a_dataset_at_a_rate_and_a_concurrency(server, tmp_path):
    dataset = tmp_path / "lengths.json"
    dataset.write_text(json.dumps([{"prompt_len": 20, "output_len": 6}, {"prompt": "The capital of France is",
                                   "output_len": 5}, {"prompt_len": 9, "output_len": 7}]))
    rc, r = bench(server, tmp_path, "--dataset", str(dataset), "--request-rate", "20", "--max-concurrency", "2")
    assert rc == 0 and r["successful_requests"] == 3, r["first_error"]
    assert [q["output_tokens"] for q in r["requests"]] == [6, 5, 7]
    assert [r["requests"][i]["prompt_tokens"] for i in (0, 2)] == [20, 9]
    assert r["request_rate"] == 20 and r["max_concurrency"] == 2
    assert_ordered(r)


def test_bench_from_client_processes_keeps_each_request_its_row(server, tmp_path):
    rc, r = bench(server, tmp_path, "--num-prompts", "5", "--input-len", "12", "--output-len", "6", "--range-ratio",
                  "0.5", "--client-processes", "2", "--max-concurrency", "3")
    assert rc == 0 and r["successful_requests"] == 5 and r["client_processes"] == 2, r["first_error"]
    rows = r["requests"]
    assert len({q["output_len"] for q in rows}) > 1  # lengths that differ: a row in the wrong place would show
    assert [q["output_tokens"] for q in rows] == [q["output_len"] for q in rows]
    assert r["total_output_tokens"] == sum(q["output_len"] for q in rows) and r["duration_s"] > 0
    assert_ordered(r)


def test_streamed_requests_one_after_another_keep_their_connection(server):
    """A stream read to its end hands its connection back to the client's pool, as the openai package does: the
    next request does not pay a new connection (and a server the accept) inside its time to first token."""
    bench_serve = load("bench_serve")
    streams = []

    async def note(response):
        streams.append(response.extensions["network_stream"])

    async def run():
        async with bench_serve.make_client(server.url, KEY, 1) as client:
            client.event_hooks["response"] = [note]
            model = (await bench_serve.served_model(client))["id"]
            bodies = [bench_serve.completion_body(model, bench_serve.RequestSpec(list(range(100 + i, 108 + i)), 3),
                                                  0.0) for i in range(3)]
            return [await bench_serve.stream_completion(client, body, 30) for body in bodies]

    results = asyncio.run(run())
    assert all(r.ok and r.completion_tokens == 3 for r in results), [r.error for r in results]
    assert len(streams) == 4 and len({id(s) for s in streams}) == 1, streams  # GET /v1/models, then the three


def test_a_stream_that_does_not_end_after_done_is_an_error_that_says_so():
    """A server that sends [DONE] and then holds the body open: the client waits for the body's end only until
    its timeout, and the error names what happened (not a missing [DONE])."""
    bench_serve = load("bench_serve")
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}\n\n'

    async def answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        body = b'data: {"choices": [{"text": "hi"}]}\n\n' + usage + b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n")
        await writer.drain()
        await asyncio.sleep(5)  # the body's last chunk never comes (the client gives up first)
        writer.close()

    async def run():
        listener = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        try:
            async with bench_serve.make_client(f"http://127.0.0.1:{port}", None, 1) as client:
                return await bench_serve.stream_completion(client, {"prompt": [1, 2], "stream": True}, 0.5)
        finally:
            listener.close()

    result = asyncio.run(run())
    assert not result.ok and result.ttft is not None and result.e2e is not None and result.text == "hi"
    assert result.error == "the stream did not end after [DONE] within --timeout 0.5 s"


def test_failed_requests_are_counted_not_fatal(server, tmp_path):
    rc, r = bench(server, tmp_path, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                  "--model", "no-such-model")
    assert rc == 1 and r["successful_requests"] == 0 and r["failed_requests"] == 3
    assert r["first_error"].startswith("HTTP 404") and "no-such-model" in r["first_error"]
    assert r["ttft_ms"]["p50"] is None and r["request_throughput"] == 0


def test_serve_load_at_a_tiny_scale(serve_target, tmp_path):
    """On the GPU the server and the offline twins run batch-invariant (what makes them comparable token for
    token), and the twins are made once the server has stopped (serve_load.py), so each sizes its pool alone."""
    out = tmp_path / "load.json"
    engine = ["--device", serve_target.device, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-context", str(MAX_CONTEXT),
              *(["--batch-invariant"] if serve_target.on_gpu else [])]
    argv = [sys.executable, str(SCRIPTS / "serve_load.py"), "--model", str(serve_target.checkpoint), *engine,
            "--num-requests", "12", "--concurrency", "4", "--disconnect-fraction", "0.25", "--prompt-len", "8", "160",
            "--max-tokens", "4", "24", "--prefix-len", "70", "--seed", "0", "--timeout", "60",
            "--startup-timeout", str(serve_target.startup_seconds), "--idle-timeout", "20", "--stop-timeout", "30",
            "--server-log", str(tmp_path / "server.log"), "--out", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: the server child goes with it
    try:
        stdout, _ = proc.communicate(timeout=120 + serve_target.startup_seconds)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0, stdout
    s = json.loads(out.read_text())
    assert s["ok"] and all(s["checks"].values()), stdout
    assert s["mismatches"] == 0 and s["pages_held_after"] == 0 and s["failed"] == 0
    assert s["finished"] + s["disconnected"] == 12 and s["disconnected"] >= 1 and s["finished"] >= 1
    assert s["server_exit_code"] == 0 and s["pages_free_after"] > 0 and s["output_tokens_per_second"] > 0


def test_serve_goals_at_a_tiny_scale(serve_target, tmp_path):
    """scripts/serve_goals.py: LLM.generate and the server on the same requests, every one back whole."""
    out = tmp_path / "goals.json"
    argv = [sys.executable, str(SCRIPTS / "serve_goals.py"), "--model", str(serve_target.checkpoint),
            "--device", serve_target.device, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-context", str(MAX_CONTEXT),
            "--num-requests", "6", "--input-len", "16", "--output-len", "5", "--ttft-requests", "2",
            "--ttft-input-len", "24", "--ttft-output-len", "3", "--client-processes", "2",
            "--startup-timeout", str(serve_target.startup_seconds), "--timeout", "60", "--out", str(out)]
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120 + serve_target.startup_seconds)
    assert done.returncode == 0, done.stdout
    s = json.loads(out.read_text())
    assert s["ok"] and all(s["checks"].values()), done.stdout
    saturation, low_load = s["served"]["saturation"], s["served"]["low_load"]
    assert s["offline"]["output_tokens"] == saturation["total_output_tokens"] == 6 * 5
    assert low_load["successful_requests"] == 2 and low_load["total_output_tokens"] == 2 * 3
    assert s["throughput_ratio"] == pytest.approx(saturation["output_throughput"] / s["offline"]["output_throughput"])
    assert 0 < s["offline"]["prefill_ms"]["p50"] and 0 < low_load["ttft_ms"]["p50"] <= low_load["e2e_ms"]["p50"]
    assert s["ttft_over_prefill_ms"] == pytest.approx(low_load["ttft_ms"]["p50"] - s["offline"]["prefill_ms"]["p50"])
    assert "| output tok/s at saturation" in done.stdout and "| time to first token at low load" in done.stdout
    # the server's own views of the two requests (its /metrics), each inside the next
    engine, server = low_load["engine_ttft_mean_ms"], low_load["server_ttft_mean_ms"]
    assert 0 < engine < server < low_load["ttft_ms"]["mean"] and "low load, means: the offline prefill" in done.stdout
