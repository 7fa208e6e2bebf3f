"""EngineClient: the server's side of the engine process (engine_process.py), for handlers on an asyncio loop.

    engine = EngineClient(model, llm_options, max_waiting=None)
    engine.start()            # spawns the engine process and waits until the model is loaded
    engine.attach(loop)       # the serving event loop reads the engine's messages from now on
    engine.submit(sub)        # a Submission: its events arrive in sub.events
    engine.abort(sub)
    engine.stop()             # aborts what is left, closes the engine process (the GPU is free after it)

Handlers never touch the engine. `submit` and `abort` put a command on a queue that a writer thread sends
down the command pipe (SimpleQueue.put is reentrant, so `stop_accepting` is safe in a signal handler). The
event loop itself reads the event pipe whenever it is readable (`loop.add_reader`): each turn's message
updates the metrics and /health's view, and a submission's events of the turn go into its handler's
asyncio.Queue as one list. Reading on the loop's own thread needs no hand-over of the interpreter lock: a
reader thread of its own would wait for the busy loop thread to let go of it (up to Python's 5 ms switch
interval), fall behind, fill the pipe and so hold up the engine. A handler that falls behind the engine finds
several lists queued and answers them in one write (app.py).

If the engine process dies, every request in flight gets Failed and later ones are refused at once;
/health says why.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import multiprocessing
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..model.tokenizer import CHAT_TEMPLATE, load_tokenizer
from . import engine_process
from .engine_process import SHUTTING_DOWN
from .events import Busy, Failed, Finished, Rejected, Report
from .metrics import ServerMetrics

log = logging.getLogger("tileinfer.server")

PIPE_BYTES = 1 << 20  # the event pipe's buffer (Linux's default limit): ~50 steps of 256 streams in flight
_F_SETPIPE_SZ = 1031


@dataclass
class Submission:
    """One request as a handler hands it over: its prompts (each text or token ids), n choices of each, and
    SamplingParams' fields. max_tokens None: all the context the prompt leaves (a chat's default)."""
    prompts: list[str | list[int]]
    sampling: dict
    stream: bool
    loop: asyncio.AbstractEventLoop
    arrival: float       # when the request reached the server (time.perf_counter())
    n: int = 1
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # lists of events, in order
    backlog: deque = field(default_factory=deque)  # the handler's: events taken from the queue, not yet read
    prompt_tokens: list[int] = field(default_factory=list)  # per prompt, once added (Added)
    sid: int = -1        # the engine's name for it, once submitted
    _left: int = 0       # choices not yet Finished (EngineClient's count)

    def __post_init__(self) -> None:
        if not isinstance(self.prompts, list) or not self.prompts:
            raise TypeError(f"Submission.prompts is a non-empty list of prompts, got {self.prompts!r}")

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def send(self, events: list) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, events)


class EngineClient:
    def __init__(self, model: str | Path, options: dict, *, max_waiting: int | None = None):
        """model: a checkpoint directory; options: tileinfer.LLM's keyword arguments; max_waiting: requests
        waiting for admission at most (more are answered 503)."""
        self.model = str(model)
        self.options = dict(options)
        self.max_waiting = max_waiting
        self.metrics = ServerMetrics()
        self.error: str | None = None  # why the engine stopped, if it did
        self.num_requests = 0          # requests the engine holds for the server, as of its last turn
        self.drained = threading.Event()  # set once, after stop_accepting, no request is left
        self.max_context = self.vocab_size = 0
        self.chat_template: str = CHAT_TEMPLATE
        self.tokenizer = None
        self._subs: dict[int, Submission] = {}  # submitted, not yet ended
        self._next_sid = 0
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._process = None
        self._writer: threading.Thread | None = None
        self._closed = False  # stop was called: submit answers at once

    # ------------------------------------------------------------------ start, stop
    def start(self) -> None:
        """Spawn the engine process and wait while it loads the model (its progress goes to stderr).
        RuntimeError, with the engine's message, if the load fails."""
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or CUDA state inherited
        command_reader, command_writer = ctx.Pipe(duplex=False)
        event_reader, event_writer = ctx.Pipe(duplex=False)
        try:
            fcntl.fcntl(event_writer.fileno(), _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:  # a smaller limit on this machine: the default buffer serves, with less slack
            pass
        self._process = ctx.Process(target=engine_process.main, name="tileinfer-engine",
                                    args=(command_reader, event_writer, self.model, self.options, self.max_waiting))
        self._process.start()
        command_reader.close()
        event_writer.close()
        self._events, self._command_pipe = event_reader, command_writer
        self.tokenizer = load_tokenizer(Path(self.model))  # while the engine loads
        try:
            message = event_reader.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the engine process exited while loading the model (exit code "
                               f"{self._process.exitcode}); its output above says why") from None
        if message[0] == "failed":
            self._process.join()
            raise RuntimeError(f"loading the model failed: {message[1]}")
        info = message[1]
        self.max_context, self.vocab_size = info["max_context"], info["vocab_size"]
        self.chat_template = info["chat_template"] or CHAT_TEMPLATE
        self._writer = threading.Thread(target=self._write, name="tileinfer-engine-commands", daemon=True)
        self._writer.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on `loop` (the server's, from its start-up) whenever the pipe has one."""
        loop.add_reader(self._events.fileno(), self._on_readable, loop)
        # uvloop's add_reader (libuv's uv_poll_init) makes the pipe non-blocking. recv must block instead: a
        # message over the pipe's atomic size (4 KiB; a turn that finishes many requests) can be readable in
        # part only, and a non-blocking read of the rest raises BlockingIOError, taken for the engine's death.
        os.set_blocking(self._events.fileno(), True)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is running, let the engine process close the LLM and end. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._commands.put(("stop",))
        if self._process is None:
            return
        self._process.join(timeout)
        if self._process.is_alive():
            log.error("the engine process did not end within %.0f s of being told to stop; killing it", timeout)
            self._process.kill()
            self._process.join()
        self._commands.put(None)  # ends the writer
        if self._writer is not None:
            self._writer.join(timeout)

    def stop_accepting(self) -> None:
        """Refuse (Failed, a 503) every request submitted from now on; those submitted before run on. Safe in a
        signal handler."""
        self._commands.put(("stop_accepting",))

    def abort_all(self) -> None:
        """End every request the engine holds now; each handler gets Failed."""
        self._commands.put(("abort_all",))

    @property
    def serving(self) -> bool:
        return self._process is not None and self._process.is_alive() and self.error is None and not self._closed

    # ------------------------------------------------------------------ requests
    def submit(self, sub: Submission) -> None:
        with self._lock:
            if not self._closed and self.error is None:
                sub.sid, self._next_sid = self._next_sid, self._next_sid + 1
                sub._left = sub.num_choices
                self._subs[sub.sid] = sub
                self._commands.put(("add", sub.sid, sub.prompts, sub.sampling, sub.stream, sub.n))
                return
        sub.send([Failed(SHUTTING_DOWN if self._closed else f"the engine stopped: {self.error}")])

    def abort(self, sub: Submission) -> None:
        with self._lock:
            if self._subs.pop(sub.sid, None) is not None:
                self._commands.put(("abort", sub.sid))

    # ------------------------------------------------------------------ the threads
    def _write(self) -> None:
        while (command := self._commands.get()) is not None:
            try:
                self._command_pipe.send(command)
            except (BrokenPipeError, OSError):
                return  # the engine process is gone: the reader says so

    def _on_readable(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the event loop: every message the pipe holds now."""
        try:
            while self._events.poll():
                message = self._events.recv()
                if message[0] == "turn":
                    self._turn(message[1], message[2])
                elif message[0] == "stopped":
                    self.drained.set()
        except (EOFError, OSError):
            loop.remove_reader(self._events.fileno())
            self._engine_gone()

    def _turn(self, items: list, report: Report) -> None:
        self.metrics.update(report)
        self.num_requests = report.requests
        if report.error is not None:
            self.error = report.error
        if report.drained:
            self.drained.set()
        with self._lock:
            for sid, events in items:
                sub = self._subs.get(sid)
                if sub is None:
                    continue  # aborted: its handler is gone
                for event in events:
                    if isinstance(event, Finished):
                        sub._left -= 1
                    elif isinstance(event, (Rejected, Busy, Failed)):
                        sub._left = 0  # the last event
                if sub._left == 0:
                    del self._subs[sid]
                sub.events.put_nowait(events)  # on the loop the handler awaits on

    def _engine_gone(self) -> None:
        """The event pipe ended: after "stopped" (or a kill at stop) that is expected; otherwise the engine
        process died, and every request in flight hears it."""
        with self._lock:
            expected = self._closed
            if not expected:
                self._process.join(5)
                code = self._process.exitcode if self._process is not None else None
                self.error = f"the engine process exited unexpectedly (exit code {code})"
                log.error("%s; the server answers every request with an error from now on", self.error)
            subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            try:
                sub.send([Failed(SHUTTING_DOWN if expected else self.error)])
            except RuntimeError:
                pass
        self.drained.set()
