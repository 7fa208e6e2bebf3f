"""EngineThread: the one thread that calls the engine, for a server whose handlers run on an asyncio loop.

The engine is single-threaded. Handlers never touch it: they `submit` a request (its prompts, n choices
of each, and the sampling fields) or `abort` one, which puts a command on a thread-safe queue. The
thread blocks on that queue while the engine is idle (no polling), and otherwise drains it between engine steps. Everything that can fail
on a request (the prompt's tokens, SamplingParams, fitting in max_context) is checked on this thread, and
the answer goes back to the handler's asyncio.Queue through `loop.call_soon_threadsafe` (a step's tokens
all in one call, `_Outbox`: one wake-up of the loop a step, not one a token):

    Added(prompt_tokens)             first, when the engine took the request, or
    Rejected(message, param)         first and last, when it could not (the handler answers 400);
    Busy(message)                    first and last, when the waiting queue is full (the handler answers 503);
    Delta(index, text, token, logprobs)  per token of choice `index` read back (streaming: text is what is
                                     safe to show; logprobs the token's entry, when asked for);
    Finished(index, output)          once per choice: the engine's RequestOutput;
    Failed(message)                  last, when the engine itself stopped (a CUDA error, a bug), or the
                                     server is shutting down (first and last for a request it refused).

Choice index = prompt number x n + choice number (OpenAI's order). The n choices of a prompt are n engine
requests; all but the first share the first one's prompt pages (Request.shares_prompt_with).

Shutting down (lifecycle.py drives it): `stop_accepting` makes the thread refuse every request submitted
after it, while those already added run on; `drained` is set once none is left; `abort_all` ends the
rest (their handlers get Failed); `stop` aborts what is left, collects a step still in flight and ends
the thread, after which `submit` answers Failed at once. The commands are handled in the order they
were queued, so a request submitted before `stop_accepting` counts as in flight, and one after it is refused.
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
    prompt_tokens: list[int]   # per prompt


@dataclass(frozen=True, slots=True)
class Rejected:
    message: str
    param: str | None


@dataclass(frozen=True, slots=True)
class Busy:
    message: str


@dataclass(frozen=True, slots=True)
class Delta:
    index: int
    text: str
    token: int                        # -1: text held back until the end (stop strings), no token of its own
    logprobs: dict | None = None      # the token's entry (token -> log-probability), when asked for


@dataclass(frozen=True, slots=True)
class Finished:
    index: int
    output: RequestOutput


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


@dataclass
class Submission:
    """One request as a handler hands it over: its prompts (each text or token ids), n choices of each, and
    SamplingParams' fields. max_tokens None: all the context the prompt leaves (a chat's default)."""
    prompts: list[str | list[int]]
    sampling: dict
    stream: bool
    loop: asyncio.AbstractEventLoop
    n: int = 1
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False   # aborted before the engine thread saw it
    prompt_tokens: list[int] = field(default_factory=list)  # per prompt, once added (Added)

    def __post_init__(self) -> None:
        if not isinstance(self.prompts, list) or not self.prompts:
            raise TypeError(f"Submission.prompts is a non-empty list of prompts, got {self.prompts!r}")

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def send(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


_STOP = object()            # abort what is left, end the thread
_STOP_ACCEPTING = object()  # refuse the requests submitted from now on
_ABORT_ALL = object()       # abort every request the thread holds

SHUTTING_DOWN = "the server is shutting down and takes no new requests; retry on another server"
ABORTED_AT_SHUTDOWN = "the server is shutting down: this request did not finish within the shutdown grace period"


class EngineThread:
    def __init__(self, engine, metrics: ServerMetrics | None = None, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting  # requests waiting for admission at most (None: no limit)
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, tuple[Request, Submission, int]] = {}  # request id -> request, submission, choice
        self._last_token: dict[int, float] = {}  # request id -> when its last token was handed out
        self._thread = threading.Thread(target=self._run, name="tileinfer-engine", daemon=True)
        self.error: str | None = None  # why the engine stopped, if it did
        self.drained = threading.Event()  # set once, after stop_accepting, no request is left
        self._accepting = True  # engine thread only
        self._closed = False    # stop was called: submit answers at once (under _lock, so nothing is left unread)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        """Refuse (Failed, a 503) every request submitted from now on; those submitted before run on. Safe in a
        signal handler: one SimpleQueue.put, which is reentrant."""
        self._commands.put(_STOP_ACCEPTING)

    def abort_all(self) -> None:
        """End every request the thread holds now; each handler gets Failed(ABORTED_AT_SHUTDOWN)."""
        self._commands.put(_ABORT_ALL)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is running, collect a step still in flight (the device is idle afterwards, so the
        LLM can be closed) and end the thread. Idempotent."""
        with self._lock:
            self._closed = True
            self._commands.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the engine thread did not end within %.0f s of being told to stop", timeout)

    @property
    def serving(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_requests(self) -> int:
        """Requests the engine holds for the server (added, not yet finished or aborted)."""
        return len(self._live)

    def submit(self, sub: Submission) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(("add", sub))
                return
        sub.send(Failed(SHUTTING_DOWN))  # the thread has ended, or is about to: nobody would answer

    def abort(self, sub: Submission) -> None:
        self._commands.put(("abort", sub))

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        self.engine.bind_thread()  # the LLM was made on another thread: the GPU's context is current there only
        if self.metrics is not None:
            self.metrics.after_step(self.engine)  # the gauges from the start, not from the first step
        while True:
            if not self._accepting and not self._live:
                self.drained.set()
            for command in self._next_commands():
                if command is _STOP:
                    self._stop()
                    return
                self._handle(command)
            if self.error is None and self.engine.has_unfinished:
                self._step()
            elif self.metrics is not None:
                self.metrics.after_step(self.engine)  # an abort frees pages without a step: the gauges say so

    def _next_commands(self) -> list:
        """Every command queued, in order; waits for the first one while the engine has nothing to run."""
        idle = self.error is not None or not self.engine.has_unfinished
        commands = [self._commands.get()] if idle else []
        try:
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _handle(self, command) -> None:
        if command is _STOP_ACCEPTING:
            self._accepting = False
        elif command is _ABORT_ALL:
            self._abort_all(ABORTED_AT_SHUTDOWN)
        else:
            kind, sub = command
            if kind == "abort":
                self._abort(sub)
            elif self._accepting:
                self._add(sub)
            else:
                sub.send(Failed(SHUTTING_DOWN))

    def _stop(self) -> None:
        self._abort_all(ABORTED_AT_SHUTDOWN)
        self.drained.set()
        try:
            self.engine.drain()  # a step launched ahead may still run on the device
        except Exception:  # the device failed under it: said in the log, the LLM is closed regardless
            log.exception("collecting the last engine step at shutdown failed")

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
            requests = self._requests(sub)
        except ValueError as e:
            sub.send(Rejected(str(e), _param_of(str(e))))
            return
        for index, req in enumerate(requests):
            self.engine.add(req, stream=sub.stream)
            self._live[req.request_id] = (req, sub, index)
        prompt_tokens = [r.num_prompt for r in requests[::sub.n]]
        if self.metrics is not None:
            self.metrics.added(sum(prompt_tokens))
        sub.send(Added(prompt_tokens))

    def _requests(self, sub: Submission) -> list[Request]:
        """The submission's engine requests, all checked before any is added (ValueError names the problem).
        Choice j > 0 of a prompt shares choice 0's prompt pages; with a seed, choice j samples with seed + j."""
        requests = []
        for i, prompt in enumerate(sub.prompts):
            ids, _ = self.engine.prompt_ids(prompt, i)
            sampling = dict(sub.sampling)
            if sampling.get("max_tokens") is None:
                sampling["max_tokens"] = max(1, self.engine.config.max_context - len(ids))
            first = None
            for j in range(sub.n):
                if j and sampling.get("seed") is not None:
                    sampling["seed"] = (sub.sampling["seed"] + j) % 2**64
                req = self.engine.make_request(ids, SamplingParams(**sampling), shares_prompt_with=first)
                first = first or req
                requests.append(req)
        return requests

    def _abort(self, sub: Submission) -> None:
        sub.cancelled = True
        for rid, (req, s, _) in list(self._live.items()):
            if s is sub:
                self.engine.abort(req)
                del self._live[rid]
                self._last_token.pop(rid, None)

    def _abort_all(self, message: str) -> None:
        for sub in {id(sub): sub for _, sub, _ in self._live.values()}.values():
            sub.send(Failed(message))
        for req, _, _ in self._live.values():
            self.engine.abort(req)
        self._live.clear()
        self._last_token.clear()

    def _step(self) -> None:
        """One engine step, its tokens handed out. If the engine fails, every request is told, and later
        ones are refused (the thread stays, so that every handler gets an answer)."""
        try:
            events = self.engine.step()
        except Exception as e:  # the engine is unusable now: every waiting client hears why
            log.exception("the engine step failed")
            self.error = f"{type(e).__name__}: {e}"
            self._abort_all(f"the engine failed: {self.error}")  # host-side only: pages go back even without a device
            return
        if self.metrics is not None:
            self.metrics.after_step(self.engine)
        outbox = _Outbox()
        for req, token, _ in events:
            live = self._live.get(req.request_id)
            if live is None:
                continue  # aborted, or not the server's
            self._time_token(req.request_id)
            _, sub, index = live
            done = req.status == FINISHED and not req.unresolved
            if sub.stream:
                entry = req.logprobs[-1] if req.logprobs else None
                outbox.add(sub, Delta(index, req.detokenizer.stream_delta(done), token, entry))
            if done:
                self._finish(req, outbox)
        for req, _, _ in [v for v in self._live.values() if v[0].status == FINISHED and not v[0].unresolved]:
            self._finish(req, outbox)  # finished without a token of its own in this step
        outbox.flush()

    def _time_token(self, request_id: int) -> None:
        if self.metrics is None:
            return
        now = time.perf_counter()
        last = self._last_token.get(request_id)
        if last is not None:
            self.metrics.itl.observe(now - last)
        self._last_token[request_id] = now

    def _finish(self, req: Request, outbox: "_Outbox") -> None:
        _, sub, index = self._live.pop(req.request_id)
        self._last_token.pop(req.request_id, None)
        if self.metrics is not None:
            self.metrics.finished(req)
        if sub.stream:
            rest = req.detokenizer.stream_delta(True)
            if rest:
                outbox.add(sub, Delta(index, rest, -1))
        outbox.add(sub, Finished(index, self.engine.output(req)))


class _Outbox:
    """One step's events for the handlers, handed to each event loop in one call_soon_threadsafe: a step of
    256 streams wakes the loop once, not 256 times (each wake-up is a write to the loop's self-pipe and a turn
    of the loop). A submission's events keep their order."""

    def __init__(self):
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}

    def add(self, sub: Submission, event) -> None:
        self._by_loop.setdefault(sub.loop, []).append((sub.events, event))

    def flush(self) -> None:
        for loop, items in self._by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)
        self._by_loop.clear()


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: each event into its handler's queue, in order."""
    for events, event in items:
        events.put_nowait(event)


def _param_of(message: str) -> str | None:
    """The field a ValueError names first (SamplingParams' messages start with it; the prompt's with
    "prompt" or "the prompt"), or None."""
    word = message.removeprefix("the ").split(" ", 1)[0].rstrip(":")
    if word == "prompt":
        return word
    return word if word in SamplingParams.__dataclass_fields__ else None
