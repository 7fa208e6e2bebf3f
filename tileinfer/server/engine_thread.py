"""EngineThread: the one thread that calls the engine, for a server whose handlers run on an asyncio loop.

The engine is single-threaded. Handlers never touch it: they `submit` a request (a prompt and its sampling
fields) or `abort` one, which puts a command on a thread-safe queue. The thread blocks on that queue while
the engine is idle (no polling), and otherwise drains it between engine steps. Everything that can fail
on a request (the prompt's tokens, SamplingParams, fitting in max_context) is checked on this thread, and
the answer goes back to the handler's asyncio.Queue through `loop.call_soon_threadsafe`:

    Added(prompt_tokens)             first, when the engine took the request, or
    Rejected(message, param)         first and last, when it could not (the handler answers 400);
    Busy(message)                    first and last, when the waiting queue is full (the handler answers 503);
    Delta(text, token)               per token read back (text: what is safe to show, streaming);
    Finished(output)                 last: the engine's RequestOutput;
    Failed(message)                  last, when the engine itself stopped (a CUDA error, a bug).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine.outputs import RequestOutput
from ..engine.params import SamplingParams
from ..engine.scheduler import FINISHED, Request
from .metrics import ServerMetrics

log = logging.getLogger("tileinfer.server")


@dataclass(frozen=True, slots=True)
class Added:
    request_id: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Rejected:
    message: str
    param: str | None


@dataclass(frozen=True, slots=True)
class Busy:
    message: str


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    token: int


@dataclass(frozen=True, slots=True)
class Finished:
    output: RequestOutput


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


@dataclass
class Submission:
    """One request as a handler hands it over: the prompt (text or token ids) and SamplingParams' fields.
    max_tokens None: all the context the prompt leaves (a chat's default)."""
    prompt: str | list[int]
    sampling: dict
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False   # aborted before the engine thread saw it

    def send(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


_STOP = object()


class EngineThread:
    def __init__(self, engine, metrics: ServerMetrics | None = None, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting  # requests waiting for admission at most (None: no limit)
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, tuple[Request, Submission]] = {}  # request id -> its request and submission
        self._last_token: dict[int, float] = {}  # request id -> when its last token was handed out
        self._thread = threading.Thread(target=self._run, name="tileinfer-engine", daemon=True)
        self.error: str | None = None  # why the engine stopped, if it did

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is running and end the thread."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    @property
    def serving(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_requests(self) -> int:
        """Requests the engine holds for the server (added, not yet finished or aborted)."""
        return len(self._live)

    def submit(self, sub: Submission) -> None:
        self._commands.put(("add", sub))

    def abort(self, sub: Submission) -> None:
        self._commands.put(("abort", sub))

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while True:
            idle = self.error is not None or not self.engine.has_unfinished
            try:
                commands = [self._commands.get()] if idle else []
                while True:  # everything else already queued, without waiting
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            if any(c is _STOP for c in commands):
                self._abort_all()
                return
            for kind, sub in commands:
                self._add(sub) if kind == "add" else self._abort(sub)
            if commands and self.metrics is not None:
                self.metrics.gauges(self.engine)  # an abort frees pages even when no step follows
            if self.error is None and self.engine.has_unfinished:
                self._step()

    def _add(self, sub: Submission) -> None:
        if sub.cancelled:
            return
        if self.error is not None:
            sub.send(Failed(f"the engine stopped: {self.error}"))
            return
        waiting = len(self.engine.scheduler.waiting)
        if self.max_waiting is not None and waiting >= self.max_waiting:
            sub.send(Busy(f"the server is busy: {waiting} requests are waiting already (--max-waiting "
                          f"{self.max_waiting}); retry later"))
            return
        try:
            ids, _ = self.engine.prompt_ids(sub.prompt)
            sampling = dict(sub.sampling)
            if sampling.get("max_tokens") is None:
                sampling["max_tokens"] = max(1, self.engine.config.max_context - len(ids))
            req = self.engine.make_request(ids, SamplingParams(**sampling))
            self.engine.add(req, stream=sub.stream)
        except ValueError as e:
            sub.send(Rejected(str(e), _param_of(str(e))))
            return
        self._live[req.request_id] = (req, sub)
        if self.metrics is not None:
            self.metrics.added(len(ids))
        sub.send(Added(req.request_id, len(ids)))

    def _abort(self, sub: Submission) -> None:
        sub.cancelled = True
        for rid, (req, s) in list(self._live.items()):
            if s is sub:
                self.engine.abort(req)
                del self._live[rid]
                self._last_token.pop(rid, None)

    def _abort_all(self) -> None:
        for req, sub in self._live.values():
            self.engine.abort(req)
            sub.send(Failed("the server is shutting down"))
        self._live.clear()

    def _step(self) -> None:
        """One engine step, its tokens handed out. If the engine fails, every request is told, and later
        ones are refused (the thread stays, so that every handler gets an answer)."""
        try:
            events = self.engine.step()
        except Exception as e:  # the engine is unusable now: every waiting client hears why
            log.exception("the engine step failed")
            self.error = f"{type(e).__name__}: {e}"
            for req, sub in self._live.values():
                self.engine.abort(req)  # host-side only: its pages go back even if the device is gone
                sub.send(Failed(f"the engine failed: {self.error}"))
            self._live.clear()
            return
        if self.metrics is not None:
            self.metrics.after_step(self.engine)
        for req, token, _ in events:
            live = self._live.get(req.request_id)
            if live is None:
                continue  # aborted, or not the server's
            self._time_token(req.request_id)
            sub = live[1]
            done = req.status == FINISHED and not req.unresolved
            if sub.stream:
                sub.send(Delta(req.detokenizer.stream_delta(done), token))
            if done:
                self._finish(req)
        for req, _ in [v for v in self._live.values() if v[0].status == FINISHED and not v[0].unresolved]:
            self._finish(req)  # finished without a token of its own in this step

    def _time_token(self, request_id: int) -> None:
        if self.metrics is None:
            return
        now = time.perf_counter()
        last = self._last_token.get(request_id)
        if last is not None:
            self.metrics.itl.observe(now - last)
        self._last_token[request_id] = now

    def _finish(self, req: Request) -> None:
        _, sub = self._live.pop(req.request_id)
        self._last_token.pop(req.request_id, None)
        if self.metrics is not None:
            self.metrics.finished(req)
        if sub.stream:
            rest = req.detokenizer.stream_delta(True)
            if rest:
                sub.send(Delta(rest, -1))
        sub.send(Finished(self.engine.output(req)))


def _param_of(message: str) -> str | None:
    """The field a ValueError names first (SamplingParams' messages start with it; the prompt's with
    "prompt" or "the prompt"), or None."""
    word = message.removeprefix("the ").split(" ", 1)[0]
    if word == "prompt":
        return word
    return word if word in SamplingParams.__dataclass_fields__ else None
