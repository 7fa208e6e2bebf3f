"""What the engine process tells the server about a request (engine_process.py sends, engine_client.py
hands them to the request's handler, app.py reads them):

    Added(prompt_tokens)             first, when the engine took the request, or
    Rejected(message, param)         first and last, when it could not (the handler answers 400);
    Busy(message)                    first and last, when the waiting queue is full (the handler answers 503);
    (index, text, token, logprobs)   a Delta, per token of choice `index` read back, for a streaming request
                                     (text is what is safe to show; token -1: text held back until the end,
                                     by stop strings, with no token of its own; logprobs: the token's entry);
    Finished(index, output)          once per choice: the engine's RequestOutput;
    Failed(message, status)          last, when the engine itself stopped (a CUDA error, a bug), or the
                                     server is shutting down (first and last for a request it refused), or
                                     first and last when checking the request failed on a bug (status 500).

A Delta is a plain tuple: a step of 256 streams pipes 256 of them, and pickle writes and reads tuples about
ten times faster than dataclasses. Choice index = prompt number x n + choice number (OpenAI's order).

After every turn of its loop the engine sends a Report with the events: its gauges and counters for
/metrics, and what /health and the shutdown read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class Added:
    prompt_tokens: list[int]   # per prompt


@dataclass(frozen=True, slots=True)
class Rejected:
    message: str
    param: str | None


@dataclass(frozen=True, slots=True)
class Busy:
    message: str


@dataclass(frozen=True, slots=True)
class Finished:
    index: int
    output: RequestOutput


@dataclass(frozen=True, slots=True)
class Failed:
    message: str
    status: int = 503  # the handler's answer before the request was taken: 500 for a bug on this request alone


def is_delta(event) -> bool:
    return type(event) is tuple


@dataclass(slots=True)
class Report:
    """The engine after one turn of its loop. Counters are totals since the start."""
    requests: int                  # requests the engine holds for the server (added, not ended)
    running: int                   # the scheduler's running and waiting requests
    waiting: int
    kv_used: int                   # KV pages held by a sequence; free ones (the cached among them)
    kv_free: int
    kv_cached: int
    preemptions: int
    prompt_tokens: int             # of the requests added
    prompt_tokens_computed: int    # positions prefill steps ran (the rest of the prompts came from the prefix cache)
    generated_tokens: int
    drained: bool                  # no longer accepting, and no request left
    error: str | None              # why the engine stopped, if it did
    itl: dict[float, int] = field(default_factory=dict)  # this turn's gaps between a request's tokens -> count
    finished: list[tuple[float | None, float | None, int, int]] = field(default_factory=list)
    # ^ per request ended this turn: time to first token, end-to-end seconds, prompt tokens, cached prompt tokens
