"""`tileinfer serve` on the CPU runner: the real server (uvicorn in a thread of this process, on 127.0.0.1, its
engine in a process of its own) talked to by the real OpenAI client. Greedy replies equal LLM.generate's on a second LLM with the same
settings; bad requests get OpenAI's error shape and the server keeps serving; a stream closed early
aborts its request. `--serve-device cuda --serve-model qwen3-0.6b` runs the same against a GPU
(tests/conftest.py)."""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pickle
import random
import signal
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from tileinfer import LLM, SamplingParams, cli
from tileinfer.chat import render_chat
from tileinfer.kv.sizing import DEFAULT_PAGE_SIZE
from tileinfer.model.tokenizer import CHAT_TEMPLATE
from tileinfer.server.app import EventStream, create_app
from tileinfer.server.engine_client import EngineClient

KEY = "sk-test-key"
NAME = "tiny-test"
MAX_NUM_SEQS, MAX_CONTEXT = 4, 512
PAGE_SIZE = DEFAULT_PAGE_SIZE
NUM_PAGES = MAX_NUM_SEQS * -(-MAX_CONTEXT // PAGE_SIZE)  # the pool, as the CPU runner and conftest.py size it


def wait_for(condition, seconds: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {seconds} s")
        time.sleep(0.05)


class Served:
    """The server's engine process, its uvicorn in a thread, and its address."""

    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.app = create_app(engine, NAME, api_key=KEY)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(self.healthy, 60, "the server's /health answering 200")

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)

    def metrics(self) -> dict[str, float]:
        return scrape(self)

    def idle(self) -> bool:
        """No request left in the engine, and every KV page free (the metrics of the engine's last turn)."""
        m = scrape(self)
        return self.engine.num_requests == 0 and m["tileinfer_requests_running"] == 0 and \
            m["tileinfer_requests_waiting"] == 0 and m["tileinfer_kv_pages_used"] == 0


@pytest.fixture(scope="module")
def reference(serve_target):
    """An LLM with the server's settings, for the expected outputs."""
    with LLM(serve_target.checkpoint, **serve_target.engine_options(MAX_NUM_SEQS, MAX_CONTEXT)) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(serve_target):
    yield from serving(serve_target.checkpoint, serve_target.engine_options(MAX_NUM_SEQS, MAX_CONTEXT))


def serving(checkpoint, settings: dict, max_waiting: int | None = None, exit_code: int = 0):
    """A fixture's body: an engine process with these settings served on 127.0.0.1, stopped after (its exit
    status exit_code)."""
    engine = EngineClient(checkpoint, settings, max_waiting=max_waiting)
    engine.start()
    try:
        s = Served(engine)
        yield s
        s.stop()
        assert not s.thread.is_alive(), "uvicorn did not stop within 30 s"
    finally:
        engine.stop()
    assert engine._process.exitcode == exit_code, f"the engine process exited with {engine._process.exitcode}"


def greedy(reference: LLM, prompt, max_tokens: int) -> str:
    return reference.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))[0].text


def chat_prompt(llm: LLM, messages: list[dict]) -> str:
    return render_chat(llm.runner.checkpoint.chat_template or CHAT_TEMPLATE, messages)


def error_of(e: openai.APIStatusError) -> dict:
    return e.response.json()["error"]


# ---------------------------------------------------------------------------- replies
def test_completion_equals_generate(served, reference):
    r = served.client().completions.create(model=NAME, prompt="The capital of France is", max_tokens=12,
                                           temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == NAME
    assert r.choices[0].text == greedy(reference, "The capital of France is", 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(reference.encode("The capital of France is"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_of_token_ids_and_stream(served, reference):
    ids = reference.encode("Once upon a time")
    expected = greedy(reference, ids, 20)
    r = served.client().completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0)
    assert r.choices[0].text == expected
    chunks = list(served.client().completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0,
                                                     stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_logprobs(served, reference):
    r = served.client().completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    expected = reference.generate("Hello", SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    assert lp.token_logprobs == pytest.approx([e[t] for t, e in zip(expected.token_ids, expected.logprobs)])
    assert all(len(top) <= 3 for top in lp.top_logprobs) and len(lp.tokens) == 4


def test_chat_equals_generate_of_the_template(served, reference):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    expected = greedy(reference, chat_prompt(reference, messages), 16)
    r = served.client().chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(reference.encode(chat_prompt(reference, messages)))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(served.client().chat.completions.create(model=NAME, messages=messages, max_tokens=16,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_concurrent_requests_each_equal_their_sequential_result(served, reference):
    prompts = [f"Request number {i} says" for i in range(6)]  # more than max_num_seqs: some wait their turn
    expected = [greedy(reference, p, 10 + 3 * i) for i, p in enumerate(prompts)]

    def ask(i: int) -> str:
        client = served.client()
        if i % 2:
            return client.completions.create(model=NAME, prompt=prompts[i], max_tokens=10 + 3 * i,
                                              temperature=0).choices[0].text
        stream = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=10 + 3 * i, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in stream)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, range(len(prompts))))
    assert got == expected


def test_models_lists_the_served_name(served):
    assert [m.id for m in served.client().models.list().data] == [NAME]


def test_n_choices_share_the_prompt_and_seeds_reproduce(served, reference):
    prompt = "Several choices of one prompt " * 50  # full pages (of 64 positions): the second choice takes them cached
    client = served.client()
    before = served.metrics()["tileinfer_prompt_tokens_computed_total"]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    computed = served.metrics()["tileinfer_prompt_tokens_computed_total"] - before
    assert computed < 1.5 * r.usage.prompt_tokens, "the second choice computed the prompt again"
    assert r.choices[0].text == r.choices[1].text == greedy(reference, prompt, 6)
    assert r.usage.prompt_tokens == len(reference.encode(prompt))  # the prompt counted once
    assert r.usage.completion_tokens == 12
    sampled = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, n=3, seed=11)
    first, again = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    chunks = list(client.completions.create(**sampled, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == [c.text for c in first.choices]


def test_a_list_of_prompts_gives_a_choice_each_in_order(served, reference):
    prompts = ["First prompt", "Second, longer prompt here"]
    r = served.client().completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.text for c in r.choices] == [greedy(reference, p, 5) for p in prompts for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(reference.encode(p)) for p in prompts)


def test_echo_puts_the_prompt_before_the_text(served, reference):
    ids = reference.encode("Echo this prompt")
    r = served.client().completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == "Echo this prompt" + greedy(reference, ids, 4)
    chunks = list(served.client().completions.create(model=NAME, prompt="Echo this prompt", max_tokens=4,
                                                     temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_min_tokens_reaches_the_engine(served, reference):
    free = reference.generate("Hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    stop = free.token_ids[0]
    r = served.client().completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=0,
                                           extra_body={"stop_token_ids": [stop], "ignore_eos": True})
    assert r.usage.completion_tokens == 1
    r = served.client().completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=0,
                                           extra_body={"stop_token_ids": [stop], "ignore_eos": True,
                                                       "min_tokens": 3})
    assert r.usage.completion_tokens >= 3


def test_streamed_logprobs_equal_the_whole_ones(served):
    client = served.client()
    whole = client.completions.create(model=NAME, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    chunks = list(client.completions.create(model=NAME, prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
                                            stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert sum((p.token_logprobs for p in parts), []) == pytest.approx(whole.choices[0].logprobs.token_logprobs)
    assert sum((p.text_offset for p in parts), []) == whole.choices[0].logprobs.text_offset
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content])


def test_logprobs_of_tokens_a_constraint_rules_out_are_the_floor_not_infinity(served):
    # A choice of one word allows a few tokens first: the other alternatives asked for have probability 0, whose
    # logprob (-inf) JSON cannot carry. They come as -9999.0 (as vLLM's server sends them), streamed or not.
    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a response: not JSON"))
    body = {"model": NAME, "prompt": "Answer:", "max_tokens": 4, "temperature": 0, "logprobs": 5,
            "structured_outputs": {"choice": ["yes"]}}
    r = post(served, "/v1/completions", body)
    assert r.status_code == 200, r.text
    logprobs = strict(r.text)["choices"][0]["logprobs"]
    values = [lp for top in logprobs["top_logprobs"] for lp in top.values()]
    assert -9999.0 in values and min(values) == -9999.0
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30, json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                                        "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 5,
                                        "structured_outputs": {"choice": ["yes"]}}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    values = [t["logprob"] for line in lines for c in strict(line)["choices"] if c["logprobs"]
              for e in c["logprobs"]["content"] for t in e["top_logprobs"]]
    assert lines and -9999.0 in values and min(values) == -9999.0


def test_tool_messages_are_rendered_by_the_template(served, reference):
    tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Bern?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call-1", "type": "function", "function": {"name": "weather",
                                                                      "arguments": '{"city": "Bern"}'}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": '{"celsius": 3}'}]
    prompt = render_chat(CHAT_TEMPLATE, [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments":
                         {"city": "Bern"}}} for c in m["tool_calls"]]} if "tool_calls" in m else m
                         for m in messages], tools=tools)
    assert "<tool_response>\n{\"celsius\": 3}\n</tool_response>" in prompt and '"name": "weather"' in prompt
    r = served.client().chat.completions.create(model=NAME, messages=messages, tools=tools, max_tokens=4,
                                                temperature=0)
    assert r.usage.prompt_tokens == len(reference.encode(prompt))
    assert r.choices[0].message.content == greedy(reference, prompt, 4)


def test_a_full_waiting_queue_is_503(serve_target):
    """max_waiting=0: no request may wait, so every one is refused before it is added."""
    for s in serving(serve_target.checkpoint, serve_target.engine_options(MAX_NUM_SEQS, MAX_CONTEXT), max_waiting=0):
        r = httpx.post(f"{s.url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", r.text
    assert "--max-waiting 0" in r.json()["error"]["message"]


def generated(served) -> float:
    return served.metrics()["tileinfer_generation_tokens_total"]


def test_a_non_streaming_client_that_goes_away_aborts_its_request(served):
    before = generated(served)
    body = json.dumps({"model": NAME, "prompt": "A long answer, please", "max_tokens": 480, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:  # sends, never reads
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
        wait_for(lambda: generated(served) - before >= 2, 30, "the request's first tokens")
    wait_for(served.idle, 10, "the abandoned request ending and its pages coming back")
    assert generated(served) - before < 480, "the request ran to the end: it was not aborted"


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kwargs, param, words", [
    (dict(temperature=-1), "temperature", "temperature must be"),
    (dict(n=0), "n", "n must be in [1, 16]"),
    (dict(echo=True, logprobs=2), "echo", "echo with logprobs"),
    (dict(extra_body={"min_tokens": 9}), "min_tokens", "min_tokens must be an integer in [0, max_tokens=4]"),
    (dict(top_p=0), "top_p", "top_p must be in (0, 1]"),
    (dict(max_tokens=MAX_CONTEXT + 88), "prompt", f"exceeds max_context ({MAX_CONTEXT})"),
    (dict(logit_bias={"x5": 10}), "logit_bias", "logit_bias keys must be token ids"),
    (dict(logit_bias={"5": 101}), "logit_bias", "numbers in [-100, 100]"),
    (dict(logit_bias={"999999999": 1}), "logit_bias", "outside the vocabulary"),
    (dict(suffix=" the end"), "suffix", "suffix (text to follow the completion"),
    (dict(best_of=3, n=2), "best_of", "best_of=3 (keeping the best"),
    (dict(extra_body={"allowed_token_ids": [5, 6]}), "allowed_token_ids", "allowed_token_ids (sampling only from a "
                                                                          "set of tokens) is not supported"),
    (dict(extra_body={"prompt_logprobs": 0}), "prompt_logprobs", "prompt_logprobs (the prompt's log-probabilities)"),
])
def test_bad_completions_are_400_naming_the_problem(served, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        served.client().completions.create(model=NAME, prompt="Hi", **{"max_tokens": 4, **kwargs})
    err = error_of(e.value)
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and words in err["message"], err


def test_what_is_refused_when_it_asks_for_something_is_taken_when_it_asks_for_nothing(served, reference):
    r = served.client().completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0, logit_bias={},
                                           suffix="", best_of=2, n=2,
                                           extra_body={"bad_words": [], "allowed_token_ids": None,
                                                       "use_beam_search": False})
    assert [c.text for c in r.choices] == [greedy(reference, "Hi", 3)] * 2


def test_logit_bias_reaches_the_sampler(served, reference):
    bias = {4242: 100.0}
    want = reference.generate("Hi", SamplingParams(max_tokens=3, temperature=0, logit_bias=bias))[0]
    assert want.token_ids == [4242] * 3
    r = served.client().completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0,
                                           logit_bias={"4242": 100})
    c = served.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=3, temperature=0, logit_bias={"4242": 100})
    assert r.choices[0].text == want.text and c.choices[0].message.content == want.text


def test_a_prompt_longer_than_the_context_is_400_with_both_lengths(served, reference):
    messages = [{"role": "user", "content": " hello" * (MAX_CONTEXT + 88)}]
    n = len(reference.encode(chat_prompt(reference, messages)))
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model=NAME, messages=messages)
    err = error_of(e.value)
    assert f"the prompt ({n} tokens)" in err["message"] and f"max_context ({MAX_CONTEXT})" in err["message"], err
    assert err["param"] == "messages"


def test_malformed_chat_bodies_and_keys(served):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{served.url}/v1/chat/completions", json={"model": NAME}, headers=headers, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(f"{served.url}/v1/chat/completions", json={"model": NAME, "messages": [{"role": "robot",
                   "content": "x"}]}, headers=headers, timeout=10)
    assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"], r.text
    with pytest.raises(openai.AuthenticationError) as e:
        served.client(api_key="wrong").models.list()
    assert e.value.status_code == 401 and "API key" in error_of(e.value)["message"]
    r = httpx.get(f"{served.url}/v1/models", timeout=10)  # no key at all
    assert r.status_code == 401
    with pytest.raises(openai.NotFoundError) as e:
        served.client().completions.create(model="other", prompt="Hi", max_tokens=2)
    assert error_of(e.value)["param"] == "model"
    # ... and it still serves
    assert served.client().completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(extra_body={"chat_template_kwargs": {"tools": 5}}), "chat_template_kwargs",
     "the chat template failed to render: TypeError"),
    (dict(extra_body={"chat_template_kwargs": {"messages": []}}), "chat_template_kwargs", "cannot set messages"),
    (dict(max_completion_tokens=0), "max_completion_tokens", "max_tokens must be an integer >= 1"),
    (dict(extra_body={"bad_words": ["Paris"]}), "bad_words", "bad_words (banning words from the output) is not"),
])
def test_bad_chats_are_400_naming_the_problem(served, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                **{"max_tokens": 4, **kwargs})
    err = error_of(e.value)
    assert err["param"] == param and words in err["message"], err


def test_a_lone_surrogate_is_400_and_the_server_serves_on(served):
    # JSON can spell half a UTF-16 pair ("\\ud800"), which no client library sends as text (so the bodies here are
    # written by hand) and the tokenizer refuses. Each place text is tokenized answers 400 naming it, and the
    # engine process lives on.
    def send(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{served.url}{path}", content=json.dumps(body).encode(), timeout=10,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    lone = "caf\ud800e"
    chat = [{"role": "user", "content": lone}]
    for path, body, param in (("/v1/completions", {"model": NAME, "prompt": lone, "max_tokens": 2}, "prompt"),
                              ("/v1/chat/completions", {"model": NAME, "messages": chat, "max_tokens": 2}, "messages.0"),
                              ("/tokenize", {"prompt": lone}, "prompt"), ("/tokenize", {"messages": chat}, "messages.0")):
        r = send(path, body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, (path, r.text)
        assert "holds a lone UTF-16 surrogate (U+D800 at character 3)" in err["message"], (path, err)
    pair = "caf\U0001F600"  # a character outside the BMP: a surrogate pair in JSON, one character here
    assert served.client().completions.create(model=NAME, prompt=pair, max_tokens=2).usage.completion_tokens == 2


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def random_body(rng: random.Random) -> tuple[str, dict]:
    """A request of random options, most of them valid together: (path, body)."""
    body = {"model": NAME, "max_tokens": rng.randint(1, 40), "temperature": rng.choice([0, 0.7, 2.0]),
            "n": rng.choice([1, 1, 2, 3]), "stream": rng.random() < 0.5}
    options = {"top_k": lambda: rng.choice([-1, 1, 50]), "min_p": lambda: rng.choice([0, 0.2]),
               "top_p": lambda: rng.choice([0.2, 1]), "presence_penalty": lambda: rng.uniform(-2, 2),
               "frequency_penalty": lambda: rng.uniform(-2, 2), "repetition_penalty": lambda: rng.uniform(0.5, 2),
               "logit_bias": lambda: {str(rng.randint(0, 300)): rng.uniform(-100, 100)},
               "seed": lambda: rng.randint(0, 2**63), "min_tokens": lambda: rng.randint(0, body["max_tokens"]),
               "ignore_eos": lambda: True, "stop": lambda: [rng.choice(["e", "\n", ".", "}"])],
               "stop_token_ids": lambda: [rng.randint(0, 300)]}
    body.update({k: make() for k, make in options.items() if rng.random() < 0.15})
    constraint = rng.random()
    if constraint < 0.15:
        body["response_format"] = {"type": "json_object"}
    elif constraint < 0.25:
        body["structured_outputs"] = {"choice": ["red", "green", "blue"]}
    elif constraint < 0.3:
        body["max_tokens"] = MAX_CONTEXT  # with the prompt, longer than the context: a 400
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        body["prompt"] = rng.choice(["Hello", [1, 2, 3], ["a", "b c"], "x " * rng.randint(1, 60)])
        body["logprobs"] = rng.choice([None, 0, 5])
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": rng.choice(["hi", "weather in Paris?", "a story"])}]
    if rng.random() < 0.5:
        body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    if rng.random() < 0.25 and constraint >= 0.25:
        body.update(tools=[TOOL], tool_choice=rng.choice(["auto", "required", "none"]))
    return "/v1/chat/completions", body


def test_random_requests_get_an_answer_or_a_400_and_leave_the_pool_free(served):
    # Seeded random mixes of the options (sampling, penalties, stops, constraints, logprobs, tools, n, streaming)
    # from three clients at once: every answer is 200 or a 400 naming the problem, every body and event strict
    # JSON (no NaN or Infinity), every stream ends in [DONE], and afterwards no page is held.
    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a response: not JSON"))

    def client(seed: int) -> list[str]:
        rng, seen = random.Random(seed), []
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            for _ in range(12):
                path, body = random_body(rng)
                with c.stream("POST", f"{served.url}{path}", json=body) as r:
                    text = "".join(r.iter_text())
                assert r.status_code in (200, 400), (r.status_code, text, body)
                if r.status_code == 400:
                    assert strict(text)["error"]["message"], (text, body)
                elif body["stream"]:
                    events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
                    assert events[-1] == "[DONE]", (text[-300:], body)
                    for event in events[:-1]:
                        assert "error" not in strict(event), (event, body)
                else:
                    assert len(strict(text)["choices"]) == body["n"] * (len(body["prompt"]) if isinstance(
                        body.get("prompt"), list) and isinstance(body["prompt"][0], str) else 1), (text, body)
                seen.append(f"{path} {r.status_code}")
        return seen

    with ThreadPoolExecutor(3) as pool:
        seen = sum(pool.map(client, range(3)), [])
    assert any("400" in s for s in seen) and sum("200" in s for s in seen) > len(seen) // 2, seen
    wait_for(served.idle, 30, "every request ending and its pages coming back")


def test_a_stream_closed_early_aborts_its_request(served):
    before = generated(served)
    stream = served.client().completions.create(model=NAME, prompt="Tell me a long story", max_tokens=480,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in zip(range(2), stream):
        pass
    stream.close()
    wait_for(served.idle, 10, "the closed stream's request ending and its pages coming back")
    assert generated(served) - before < 480, "the request ran to the end: it was not aborted"
    assert httpx.get(f"{served.url}/health", timeout=5).json() == {"status": "serving", "requests": 0}


def test_unknown_fields_are_ignored_with_one_log_line(served, reference, caplog):
    with caplog.at_level("WARNING", logger="tileinfer.server"):
        r = served.client().completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0,
                                               extra_body={"frobnicate": 1, "logit_bias_x": 2})
    assert r.choices[0].text == greedy(reference, "Hi", 3)
    lines = [rec.getMessage() for rec in caplog.records if "ignoring" in rec.getMessage()]
    assert lines == ["/v1/completions: ignoring fields this server does not use: frobnicate, logit_bias_x"]


def test_chat_template_kwargs_reach_the_template(served, reference):
    messages = [{"role": "user", "content": "Hi"}]
    prompt = render_chat(reference.runner.checkpoint.chat_template or CHAT_TEMPLATE, messages, enable_thinking=False)
    assert "<think>" in prompt  # Qwen3's template writes an empty think block when thinking is off
    r = served.client().chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0,
                                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(reference.encode(prompt))
    assert r.choices[0].message.content == greedy(reference, prompt, 4)


def test_a_stop_string_is_kept_with_include_stop_str_in_output(served, reference):
    full = greedy(reference, "Hello", 8)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    for include, text in ((False, cut), (True, cut + stop)):
        r = served.client().completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0, stop=stop,
                                               extra_body={"include_stop_str_in_output": include})
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text, (include, stop, r.choices[0])


def test_skip_special_tokens_reaches_the_request():
    from tileinfer.server.protocol import ChatCompletionRequest
    body = ChatCompletionRequest(model=NAME, messages=[{"role": "user", "content": "Hi"}], skip_special_tokens=False)
    assert body.sampling(4, None)["skip_special_tokens"] is False
    assert "skip_special_tokens" not in ChatCompletionRequest(model=NAME, messages=[{"role": "user", "content": "Hi"}]
                                                              ).sampling(4, None)  # SamplingParams' default


def test_stop_token_ids_end_a_reply(served, reference):
    full = reference.generate("Hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    stop = full.token_ids[2]
    r = served.client().completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=0,
                                           extra_body={"stop_token_ids": [stop], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == full.token_ids.index(stop) + 1


# ---------------------------------------------------------------------------- tokenize, metrics
def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)


def test_tokenize_and_detokenize(served, reference):
    r = post(served, "/tokenize", {"model": NAME, "prompt": "The capital of France is"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == reference.encode("The capital of France is") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_CONTEXT
    messages = [{"role": "user", "content": "Hi there"}]
    r = post(served, "/tokenize", {"messages": messages})
    assert r.json()["tokens"] == reference.encode(chat_prompt(reference, messages))
    r = post(served, "/detokenize", {"model": NAME, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "The capital of France is"}
    r = post(served, "/detokenize", {"tokens": [1, 10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and "vocabulary" in r.text
    r = post(served, "/tokenize", {"prompt": "x", "messages": messages})
    assert r.status_code == 400 and "exactly one of prompt or messages" in r.text, r.text
    assert httpx.post(f"{served.url}/tokenize", json={"prompt": "x"}, timeout=10).status_code == 401  # no key


def scrape(served) -> dict[str, float]:
    """Every sample of GET /metrics: name (with labels, e.g. a histogram's le) -> value."""
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(f"{served.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_what_the_requests_did(served, reference):
    before = scrape(served)
    prompt = "Metrics, please"
    outs = [served.client().completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                               extra_body={"ignore_eos": True}) for n in (5, 9)]
    wait_for(lambda: served.engine.num_requests == 0, 10, "both requests ending")
    after = scrape(served)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("tileinfer_generation_tokens_total") == sum(o.usage.completion_tokens for o in outs) == 14
    assert grew("tileinfer_prompt_tokens_total") == 2 * len(reference.encode(prompt))
    assert grew("tileinfer_time_to_first_token_seconds_count") == 2
    assert grew("tileinfer_e2e_request_latency_seconds_count") == 2
    assert grew("tileinfer_inter_token_latency_seconds_count") == (5 - 1) + (9 - 1)  # gaps between a request's tokens
    assert after["tileinfer_requests_running"] == 0 and after["tileinfer_requests_waiting"] == 0
    assert after["tileinfer_kv_pages_used"] + after["tileinfer_kv_pages_free"] == NUM_PAGES
    assert 0 <= after["tileinfer_prefix_cache_hit_rate"] <= 1
    assert "tileinfer_preemptions_total" in after


def test_streamed_first_tokens_are_timed_at_the_server_around_the_engines(served):
    """tileinfer_http_time_to_first_token_seconds: one per streamed request (a completion and a chat here), none
    for a whole reply; each spans its request's engine time to first token (the engine's lies inside it)."""
    before = scrape(served)
    client = served.client()
    for _ in client.completions.create(model=NAME, prompt="Timed at the server", max_tokens=4, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}):
        pass
    for _ in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}):
        pass
    wait_for(lambda: served.engine.num_requests == 0, 10, "both streamed requests ending")
    middle = scrape(served)
    client.completions.create(model=NAME, prompt="Not streamed", max_tokens=2, temperature=0)
    wait_for(lambda: served.engine.num_requests == 0, 10, "the whole reply's request ending")
    after = scrape(served)

    def grew(name: str, a: dict, b: dict) -> float:
        return b[name] - a.get(name, 0.0)

    http, engine = "tileinfer_http_time_to_first_token_seconds", "tileinfer_time_to_first_token_seconds"
    assert grew(f"{http}_count", before, middle) == 2 and grew(f"{engine}_count", before, middle) == 2
    assert grew(f"{http}_sum", before, middle) > grew(f"{engine}_sum", before, middle) > 0
    assert grew(f"{http}_count", middle, after) == 0 and grew(f"{engine}_count", middle, after) == 1



def test_page_gauges_after_an_abort_without_a_later_step(served):
    """A request with a penalty runs synchronous steps: once it is aborted no step follows, yet the gauges
    must show its pages back; pages the prefix cache keeps count as free and as cached, never as used."""
    prompt = list(range(1000, 1000 + 2 * PAGE_SIZE + 5))  # two full pages: cached once it ends
    stream = served.client().completions.create(model=NAME, prompt=prompt, max_tokens=300, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True,
                                                                         "repetition_penalty": 1.1})
    for _ in zip(range(2), stream):
        pass
    stream.close()
    wait_for(served.idle, 10, "the closed stream's request ending and the gauges showing it")
    m = scrape(served)
    assert m["tileinfer_kv_pages_free"] == NUM_PAGES
    assert m["tileinfer_kv_pages_cached"] >= 2


# ---------------------------------------------------------------------------- health, CLI
def test_health_is_503_until_the_app_starts(served):
    assert TestClient(create_app(served.engine, NAME)).get("/health").status_code == 503  # lifespan not run


def test_allowed_origins_get_cors_headers_and_others_none(served):
    page = "http://localhost:3000"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    open_app = TestClient(create_app(served.engine, NAME, api_key=KEY, allowed_origins=[page]))
    r = open_app.options("/v1/chat/completions", headers=preflight)  # a preflight carries no key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page, r.headers
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = open_app.get("/v1/models", headers={"Origin": page, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
    assert open_app.get("/v1/models", headers={"Origin": page}).status_code == 401  # the key is still needed
    r = open_app.get("/v1/models", headers={"Origin": "http://elsewhere", "Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in r.headers
    closed = TestClient(create_app(served.engine, NAME, api_key=KEY))  # the default: no CORS at all
    assert "access-control-allow-origin" not in closed.options("/v1/chat/completions", headers=preflight).headers


@pytest.mark.parametrize("argv, words", [
    (["--model", "/no/such/dir"], "no such checkpoint directory"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1"),
    (["--allowed-origins", "localhost:3000"], "--allowed-origins: 'localhost:3000' is not an origin"),
    (["--allowed-origins", "http://a.example/path"], "'http://a.example/path' is not an origin"),
])
def test_serve_checks_its_arguments_before_loading(capsys, tiny_checkpoint, argv, words):
    rc = cli.main(["serve", "--device", "cpu", "--model", str(tiny_checkpoint), *argv])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and words in err, err


def test_a_bug_in_checking_one_request_fails_it_alone(reference, monkeypatch):
    """The engine loop alone: where checking a request raises what no check means (a bug), that request gets
    Failed with status 500 and nothing of it is added; the loop serves the next one."""
    from tileinfer.server.engine_process import EngineLoop
    from tileinfer.server.events import Added, Failed, Finished

    real = reference.engine.prompt_ids

    def prompt_ids(prompt, index=0):
        if prompt == "trips a bug":
            raise TypeError("a simulated bug")
        return real(prompt, index)
    monkeypatch.setattr(reference.engine, "prompt_ids", prompt_ids)
    sent = []
    sampling = {"max_tokens": 3, "temperature": 0}
    commands = [("add", 0, ["Hi", "trips a bug"], sampling, False, 1), ("add", 1, ["Hi"], sampling, False, 1)]
    try:
        loop = EngineLoop(reference.engine, sent.append)
        loop.run(lambda block: commands.pop(0) if commands else ("stop",) if block else None)
    finally:
        monkeypatch.undo()
    events = {}
    for message in sent:
        for sid, evs in message[1]:
            events.setdefault(sid, []).extend(evs)
    failed, = events[0]
    assert isinstance(failed, Failed) and failed.status == 500 and "TypeError: a simulated bug" in failed.message
    assert isinstance(events[1][0], Added) and isinstance(events[1][-1], Finished)
    want = reference.generate(["Hi"], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    assert events[1][-1].output.token_ids == want
    assert not reference.engine.has_unfinished


def test_an_engine_failure_answers_every_request(reference, monkeypatch):
    """The engine loop alone, in this process, on the reference LLM's engine whose step is made to fail: the
    request in flight gets Failed, a later one is refused at once, the Report names the error."""
    from tileinfer.server.engine_process import EngineLoop
    from tileinfer.server.events import Added, Failed

    def broken_step():
        raise RuntimeError("a simulated GPU error")
    monkeypatch.setattr(reference.engine, "step", broken_step)
    sent = []
    sampling = {"max_tokens": 4, "temperature": 0}
    commands = [("add", 0, ["Hello"], sampling, False, 1), ("add", 1, ["Hi"], sampling, True, 1), ("stop",)]
    try:
        EngineLoop(reference.engine, sent.append).run(lambda block: commands.pop(0) if block else None)
    finally:
        monkeypatch.undo()
    start, (first, report), (second, _), _ = [(dict(m[1]), m[2]) for m in sent]  # start: the gauges alone
    assert start[0] == {} and start[1].requests == 0
    added, failed = first[0]
    assert isinstance(added, Added) and isinstance(failed, Failed) and "simulated GPU error" in failed.message
    assert "simulated GPU error" in report.error and report.requests == 0
    refused, = second[1]
    assert isinstance(refused, Failed) and "the engine stopped" in refused.message
    assert not reference.engine.has_unfinished, "the failed request was left in the engine"


@pytest.fixture
def doomed(serve_target):
    """A server of its own, whose engine process the test kills."""
    yield from serving(serve_target.checkpoint, serve_target.engine_options(MAX_NUM_SEQS, MAX_CONTEXT),
                       exit_code=-signal.SIGKILL)


def test_a_dead_engine_process_fails_its_requests_and_health_says_so(doomed):
    stream = doomed.client().completions.create(model=NAME, prompt="Tell me a long story", max_tokens=480,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    doomed.engine._process.kill()
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            pass
    assert "engine process exited unexpectedly" in str(e.value.body or e.value.message), e.value
    r = httpx.get(f"{doomed.url}/health", timeout=5)
    assert r.status_code == 503 and "engine process exited" in r.json()["status"], r.text
    with pytest.raises(openai.APIStatusError) as e:
        doomed.client().completions.create(model=NAME, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 503 and "engine process exited" in error_of(e.value)["message"]


# ---------------------------------------------------------------------------- the stream's response, the event pipe
def chunks_then_wait(closed: list, ready: int):
    """A stream's generator: `ready` chunks, then it waits (an engine with nothing yet) for one more; its finally,
    where _stream aborts the request, says in `closed` that it ran."""
    async def chunks():
        try:
            for i in range(ready):
                yield f"data: {i}\n\n"
            await asyncio.sleep(30)
            yield "data: late\n\n"
        finally:
            closed.append(True)
    return chunks()


def run_event_stream(chunks, leave_after: bytes | None) -> list[dict]:
    """EventStream(chunks) under a server whose client disconnects once it was sent `leave_after` (never if
    None); the messages sent. Fails if the response takes 5 s, or leaves a task behind."""
    async def run() -> list[dict]:
        sent, gone = [], asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message.get("body") == leave_after:
                gone.set()

        await asyncio.wait_for(EventStream(chunks)({"type": "http"}, receive, send), 5)
        assert asyncio.all_tasks() == {asyncio.current_task()}, "the response left a task running"
        return sent
    return asyncio.run(run())


def test_an_event_stream_whose_client_goes_away_stops_and_closes_its_generator():
    closed = []
    sent = run_event_stream(chunks_then_wait(closed, 2), leave_after=b"data: 1\n\n")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert closed, "the generator was not closed: its request would not be aborted"


def test_an_event_stream_sends_every_chunk_then_the_end():
    async def chunks():
        yield "data: é\n\n"
        yield "data: [DONE]\n\n"
    sent = run_event_stream(chunks(), leave_after=None)
    assert sent[0]["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [("data: é\n\n".encode(), True),
                                                            (b"data: [DONE]\n\n", True), (b"", False)]


def test_the_event_pipe_is_read_whole_under_uvloop():
    """uvloop's add_reader makes a file non-blocking; attach undoes it, so that a message the engine has written
    in part only (a big turn) is read whole once the rest comes, not taken for the engine's death."""
    uvloop = pytest.importorskip("uvloop")
    reader, writer = multiprocessing.Pipe(duplex=False)
    engine = EngineClient("unused", {})
    engine._events = reader
    loop = uvloop.new_event_loop()
    try:
        engine.attach(loop)
        data = pickle.dumps(("turn", "x" * 10_000))
        message = struct.pack("!i", len(data)) + data  # multiprocessing's framing: the length, then the pickle
        os.write(writer.fileno(), message[:1000])
        rest = threading.Timer(0.2, os.write, (writer.fileno(), message[1000:]))
        rest.start()
        assert reader.recv() == ("turn", "x" * 10_000)
        rest.join()
    finally:
        loop.remove_reader(reader.fileno())
        loop.close()
        reader.close()
        writer.close()
