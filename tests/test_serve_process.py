"""`tileinfer serve` as users run it: `python -m tileinfer serve --device cpu` in a process of its own on
127.0.0.1 (or on a GPU: tests/conftest.py's --serve-device), talked to by the official OpenAI client.
Many concurrent clients get what each request gets alone; a client gone mid-stream gives its KV pages
back; SIGTERM stops taking requests at once (/health 503, new requests 503), lets the requests in flight
finish within --shutdown-timeout, aborts the rest (an error chunk and [DONE], or a 503), and the process
exits 0. The server's output is printed at teardown, so a failing test shows it."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tileinfer import LLM, SamplingParams
from tileinfer.chat import render_chat
from tileinfer.model.tokenizer import CHAT_TEMPLATE
from tileinfer.server.reasoning import split

from test_server import wait_for

KEY = "K"
NAME = "tiny"
MAX_NUM_SEQS = 8
MAX_CONTEXT = {"cpu": 512, "cuda": 8192}
# Tokens of a request that must still run after what a test does meanwhile (a grace of 1 s, the checks
# during a drain), and of requests that run past a SIGTERM's checks yet end well within a grace of 30 s:
# the CPU runner decodes the tiny model at tens of tokens a second, a GPU qwen3-0.6b at up to ~2,000.
LONG_TOKENS = {"cpu": 380, "cuda": 6000}  # PROMPTS[6] (121 tokens) + 380 fit 512
FINISHING_TOKENS = {"cpu": 96, "cuda": 1500}
ERROR_FIELDS = {"message", "type", "param", "code"}  # OpenAI's error object
EXIT_MARGIN = 15.0  # seconds past the grace a stopped server may take to exit (a loaded 2-core CI machine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """One `tileinfer serve` subprocess, its output (stdout and stderr) in a file."""

    def __init__(self, target, log_path, *options: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        serve = [*target.serve_options(MAX_NUM_SEQS, MAX_CONTEXT[target.device]), "--host", "127.0.0.1",
                 "--api-key", KEY, "--served-model-name", NAME]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tileinfer", "serve", "--model",
                                          str(target.checkpoint), *serve, "--port", str(self.port), *options],
                                         stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(self.started, target.startup_seconds, "the server answering /health 200")
        except BaseException:
            self.close()
            raise

    def started(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the server exited with status {self.proc.returncode} before serving")
        try:
            return self.health().status_code == 200
        except httpx.TransportError:
            return False

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=5)

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of GET /metrics: name -> value."""
        lines = httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines()
        samples = (line.split(" ") for line in lines if line and not line.startswith("#") and "{" not in line)
        return {name: float(value) for name, value in samples}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        print(f"---- tileinfer serve's output ({self.log_path}):\n{self.log_path.read_text()}")


@pytest.fixture
def launch(serve_target, tmp_path):
    """launch(*options) starts a server; every one started is killed (if still running) at teardown."""
    started = []

    def start(*options: str) -> ServeProcess:
        started.append(ServeProcess(serve_target, tmp_path / f"serve-{len(started)}.log", *options))
        return started[-1]
    yield start
    for server in started:
        server.close()


@pytest.fixture(scope="module")
def reference(serve_target):
    options = serve_target.engine_options(MAX_NUM_SEQS, MAX_CONTEXT[serve_target.device])
    with LLM(serve_target.checkpoint, **options) as llm:
        yield llm


@pytest.fixture(scope="module")
def long_tokens(serve_target) -> int:
    return LONG_TOKENS[serve_target.device]


def alone(reference: LLM, prompt: str, max_tokens: int, ignore_eos: bool = False) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    return reference.generate(prompt, params)[0].text


def chat_prompt(reference: LLM, text: str) -> str:
    template = reference.runner.checkpoint.chat_template or CHAT_TEMPLATE
    return render_chat(template, [{"role": "user", "content": text}])


# ---------------------------------------------------------------------------- many clients, a client gone
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,",
           "Tell me a story about a dragon who", "Hello", "The quick brown fox jumps over the lazy dog. " * 12,
           "Water boils at"]


def ask(server: ServeProcess, start: threading.Barrier, i: int) -> str:
    """Request i of 32: completions and chats, streaming or not, of several lengths; its text."""
    text, max_tokens = PROMPTS[i % len(PROMPTS)], 4 + (i * 5) % 21
    chat, stream = i % 4 >= 2, i % 2 == 1
    client = server.client()
    start.wait(30)
    if chat:
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}],
                                           max_tokens=max_tokens, temperature=0, stream=stream)
        return "".join(c.choices[0].delta.content or "" for c in r) if stream else r.choices[0].message.content
    r = client.completions.create(model=NAME, prompt=text, max_tokens=max_tokens, temperature=0, stream=stream)
    return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text


def expected(reference: LLM, i: int) -> str:
    text, max_tokens = PROMPTS[i % len(PROMPTS)], 4 + (i * 5) % 21
    if i % 4 >= 2:
        return split(alone(reference, chat_prompt(reference, text), max_tokens))[1]
    return alone(reference, text, max_tokens)


@pytest.fixture(scope="module")
def shared(serve_target, tmp_path_factory):
    """One server for the tests that leave it serving."""
    server = ServeProcess(serve_target, tmp_path_factory.mktemp("serve") / "serve.log")
    yield server
    server.close()


def test_32_concurrent_clients_each_get_what_their_request_gets_alone(shared, reference):
    start = threading.Barrier(32)
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda i: ask(shared, start, i), range(32)))
    assert got == [expected(reference, i) for i in range(32)]
    wait_for(lambda: shared.health().json() == {"status": "serving", "requests": 0}, 10, "every request ending")


def test_a_client_gone_mid_stream_gives_its_pages_back(shared, long_tokens):
    wait_for(lambda: shared.metrics()["tileinfer_requests_running"] == 0, 10, "the server being idle")
    before = shared.metrics()
    pages = before["tileinfer_kv_pages_used"] + before["tileinfer_kv_pages_free"]
    assert before["tileinfer_kv_pages_used"] == 0, before  # nothing running holds a page
    stream = shared.client().completions.create(model=NAME, prompt=PROMPTS[6], max_tokens=long_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    for _ in zip(range(3), stream):
        pass
    during = shared.metrics()
    assert during["tileinfer_requests_running"] == 1 and during["tileinfer_kv_pages_used"] >= 2, during
    stream.close()
    # Its pages are free again. With prefix caching (on) its full pages stay registered for a later prompt, but
    # as cached-free pages: those count as free (kv/block_manager.py), so "used" goes back to 0.
    wait_for(lambda: shared.metrics()["tileinfer_kv_pages_used"] == 0, 10, "the aborted request's pages coming back")
    after = shared.metrics()
    assert after["tileinfer_requests_running"] == 0 and after["tileinfer_requests_waiting"] == 0, after
    assert after["tileinfer_kv_pages_free"] == pages, after
    generated = after["tileinfer_generation_tokens_total"] - before["tileinfer_generation_tokens_total"]
    assert 3 <= generated < long_tokens, f"{generated} tokens: the request was not aborted when its client went away"
    assert shared.health().json() == {"status": "serving", "requests": 0}


def test_engine_options_reach_the_engine(launch, reference, serve_target):
    """A draft model (speculation: not pipelined, so an abort frees pages without a later step), an explicit
    pool of small pages, no prefix caching, small prefill chunks: greedy text is still the reference's."""
    server = launch("--draft-model", str(serve_target.checkpoint), "--num-draft-tokens", "2", "--page-size", "16",
                    "--max-context", "512", "--num-pages", "40", "--no-prefix-caching",
                    "--max-num-batched-tokens", "64")
    idle = server.metrics()
    assert idle["tileinfer_kv_pages_free"] == 40 and idle["tileinfer_kv_pages_used"] == 0, idle
    r = server.client().completions.create(model=NAME, prompt=PROMPTS[6], max_tokens=12, temperature=0)
    assert r.choices[0].text == alone(reference, PROMPTS[6], 12)
    stream = server.client().completions.create(model=NAME, prompt=PROMPTS[6], max_tokens=380, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})  # 501 of 512
    for _ in zip(range(3), stream):
        pass
    assert server.metrics()["tileinfer_kv_pages_used"] >= 8  # 121 prompt tokens in pages of 16
    stream.close()
    wait_for(lambda: server.metrics()["tileinfer_kv_pages_used"] == 0, 10, "the aborted request's pages coming back")
    assert server.health().json() == {"status": "serving", "requests": 0}


# ---------------------------------------------------------------------------- SIGTERM
class Streamer(threading.Thread):
    """One streaming completion with the OpenAI client: its text, and the error that ended it if one did."""

    def __init__(self, server: ServeProcess, prompt: str, max_tokens: int):
        super().__init__(daemon=True)
        self.server, self.prompt, self.max_tokens = server, prompt, max_tokens
        self.first = threading.Event()
        self.text, self.finish_reason, self.error = "", None, None

    def run(self) -> None:
        try:
            for chunk in self.server.client().completions.create(
                    model=NAME, prompt=self.prompt, max_tokens=self.max_tokens, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}):
                self.first.set()
                self.text += chunk.choices[0].text
                self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
        except openai.APIError as e:
            self.error = e
        finally:
            self.first.set()


def check_refused_while_stopping(server: ServeProcess, client: openai.OpenAI) -> None:
    """/health and a new request are answered 503 while the requests in flight drain. The client is made
    before the signal: making one reads the system's certificates, a good part of a 1 s grace on a busy CPU."""
    def stopping() -> bool:
        try:
            return server.health().status_code == 503
        except httpx.TransportError:  # uvicorn's own shutdown closes the sockets at the signal
            pytest.fail("the server stopped listening at SIGTERM instead of answering 503 while it drains")
    wait_for(stopping, 5, "/health turning 503 after SIGTERM")
    health = server.health().json()
    assert health["status"] == "stopping" and health["requests"] >= 1, health  # requests still in flight
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=NAME, prompt="Hi", max_tokens=2)
    error = e.value.response.json()["error"]
    assert e.value.status_code == 503 and set(error) == ERROR_FIELDS and "shutting down" in error["message"], error


def test_sigterm_lets_the_requests_in_flight_finish_and_exits_0(launch, reference, serve_target):
    grace, tokens = 30, FINISHING_TOKENS[serve_target.device]
    server = launch("--shutdown-timeout", str(grace))
    streams = [Streamer(server, prompt, tokens) for prompt in PROMPTS[:3]]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(30), "no stream got its first token"
    client = server.client()
    stopped = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    check_refused_while_stopping(server, client)
    for s in streams:
        s.join(grace + EXIT_MARGIN)
    for s, prompt in zip(streams, PROMPTS[:3]):
        assert s.error is None and s.finish_reason == "length", (s.error, s.finish_reason)
        assert s.text == alone(reference, prompt, tokens, ignore_eos=True)
    assert server.proc.wait(grace + EXIT_MARGIN) == 0
    assert time.monotonic() - stopped < grace + EXIT_MARGIN


def raw_stream(server: ServeProcess, prompt: str, max_tokens: int, lines: list[str], first: threading.Event) -> None:
    """A streaming completion read line by line with httpx, to see the exact end of the stream."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                first.set()


def test_requests_past_a_short_grace_are_aborted_and_the_server_exits_0(launch, long_tokens):
    grace = 1
    server = launch("--shutdown-timeout", str(grace))
    streams = [Streamer(server, prompt, long_tokens) for prompt in PROMPTS[:2]]
    lines, raw_first = [], threading.Event()
    raw = threading.Thread(target=raw_stream, args=(server, PROMPTS[2], long_tokens, lines, raw_first), daemon=True)
    waiting = {}

    def wait_whole() -> None:
        try:
            waiting["reply"] = server.client().completions.create(
                model=NAME, prompt=PROMPTS[3], max_tokens=long_tokens, temperature=0, extra_body={"ignore_eos": True})
        except openai.APIStatusError as e:
            waiting["error"] = e
    whole = threading.Thread(target=wait_whole, daemon=True)
    for t in [*streams, raw, whole]:
        t.start()
    for first in [s.first for s in streams] + [raw_first]:
        assert first.wait(30), "no stream got its first token"
    wait_for(lambda: server.health().json()["requests"] == 4, 10, "all four requests running")
    client = server.client()
    stopped = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    check_refused_while_stopping(server, client)
    for t in [*streams, raw, whole]:
        t.join(grace + EXIT_MARGIN)
        assert not t.is_alive(), "a request was still open after the grace"
    for s in streams:  # the error chunk reaches the OpenAI client as an APIError
        assert s.error is not None and "shutdown grace period" in str(s.error), (s.error, s.finish_reason)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert set(error) == ERROR_FIELDS and "shutdown grace period" in error["message"], error
    assert '"finish_reason": "length"' not in "".join(lines)
    assert "reply" not in waiting and waiting["error"].status_code == 503, waiting
    assert set(waiting["error"].response.json()["error"]) == ERROR_FIELDS
    assert server.proc.wait(grace + EXIT_MARGIN) == 0
    assert time.monotonic() - stopped < grace + EXIT_MARGIN
