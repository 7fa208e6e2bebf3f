"""The engine process: the one process that holds the GPU and runs the engine loop, for the server's
handlers in another process (engine_client.py starts it and talks to it over two pipes).

The server's HTTP work (parsing requests, encoding and writing a Server-Sent Event per stream and step)
is Python, as is the engine's host side of a step. In one process the two would share one interpreter
lock, and at hundreds of streams the handlers' work would hold up every decode step. In a process of its
own the engine steps as it does offline, and the server takes each step's tokens when it can (a handler
that fell behind sends several steps' tokens in one chunk).

    main(commands, events, model, options, max_waiting)   # the process's entry (engine_client.py)

Commands arrive in order: ("add", sid, prompts, sampling, stream, n), ("abort", sid), ("stop_accepting",),
("abort_all",), ("stop",). Everything that can fail on a request (the prompt's tokens, SamplingParams,
fitting in max_context) is checked here. After every turn of the loop (the commands queued, then one
engine step) one message goes back: ("turn", [(sid, [event, ...]), ...], Report), events.py's events in
order. The loop blocks on the command pipe while the engine is idle (no polling).

Shutting down: "stop_accepting" makes the loop refuse every request added after it, while those already
added run on; the Report says `drained` once none is left; "abort_all" ends the rest (each gets Failed);
"stop" aborts what is left, collects a step still in flight and ends the loop, after which the LLM is
closed (the GPU freed) and ("stopped",) is sent. The process ignores SIGINT and SIGTERM (a Ctrl-C reaches
the whole process group): the server decides, and if the server dies the command pipe ends and so does
this process.
"""
from __future__ import annotations

import logging
import signal
import time
from collections import Counter

from ..engine.detokenize import TokenBytes
from ..engine.params import SamplingParams
from ..engine.scheduler import FINISHED, Request
from .events import Added, Busy, Failed, Finished, Rejected, Report

log = logging.getLogger("tileinfer.server")

SHUTTING_DOWN = "the server is shutting down and takes no new requests; retry on another server"
ABORTED_AT_SHUTDOWN = "the server is shutting down: this request did not finish within the shutdown grace period"


def main(commands, events, model: str, options: dict, max_waiting: int | None) -> None:
    """Load the LLM, say ("ready", info) or ("failed", message), serve the commands until "stop" (or until
    the server's end of a pipe closes), close the LLM, say ("stopped",)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    from .. import LLM
    try:
        llm = LLM(model, **options)
    except Exception as e:  # noqa: BLE001 - whatever stops the load, the server says it and exits
        log.exception("loading the model failed")
        events.send(("failed", f"{type(e).__name__}: {e}"))
        return
    with llm:
        TokenBytes.of(llm.tokenizer)  # the streams' detokenizers' table, built now rather than at the first stream
        template = llm.runner.checkpoint.chat_template
        events.send(("ready", {"max_context": llm.config.max_context, "vocab_size": llm.model_config.vocab_size,
                               "chat_template": template}))
        loop = EngineLoop(llm.engine, events.send, max_waiting)
        try:
            loop.run(lambda block: commands.recv() if block or commands.poll() else None)
        except (EOFError, BrokenPipeError):  # the server went away: nobody is left to answer
            log.warning("the server's end of the engine's pipes closed; the engine process stops")
            loop.stop()
            return
    events.send(("stopped",))


class EngineLoop:
    """The engine loop over an Engine. send(message) takes each turn's ("turn", items, Report)."""

    def __init__(self, engine, send, max_waiting: int | None = None):
        self.engine = engine
        self.send = send
        self.max_waiting = max_waiting  # requests waiting for admission at most (None: no limit)
        self._live: dict[int, tuple[Request, int, bool, int]] = {}  # request id -> request, sid, stream, choice
        self._last_token: dict[int, float] = {}  # request id -> when its last token was read back
        self._ending: dict[int, Request] = {}  # finished, but a launched step still holds a row of it
        self._outbox: dict[int, list] = {}  # sid -> its events of this turn, in order
        self._itl: Counter = Counter()
        self._finished: list = []
        self._prompt_tokens = 0
        self.error: str | None = None  # why the engine stopped, if it did
        self._accepting = True

    def run(self, next_command) -> None:
        """Serve commands until "stop". next_command(block) returns the next command, or None if none is
        queued and block is False."""
        self._flush()  # the gauges from the start, not from the first request
        while True:
            idle = self.error is not None or not self.engine.has_unfinished
            command = next_command(idle)
            while command is not None:
                if command[0] == "stop":
                    self.stop()
                    self._flush()
                    return
                self._handle(command)
                command = next_command(False)
            if self.error is None and self.engine.has_unfinished:
                self._step()
            self._flush()

    def stop(self) -> None:
        """Abort what is left and collect a step still in flight (the device is idle afterwards)."""
        self._abort_all(ABORTED_AT_SHUTDOWN)
        try:
            self.engine.drain()
        except Exception:  # noqa: BLE001 - the device failed under it: said in the log, the LLM is closed regardless
            log.exception("collecting the last engine step at shutdown failed")

    # ------------------------------------------------------------------ commands
    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            self._abort(command[1])
        elif kind == "stop_accepting":
            self._accepting = False
        elif kind == "abort_all":
            self._abort_all(ABORTED_AT_SHUTDOWN)
        else:
            raise ValueError(f"the engine loop has no command {kind!r}")

    def _add(self, sid: int, prompts: list, sampling: dict, stream: bool, n: int) -> None:
        if not self._accepting:
            self._say(sid, Failed(SHUTTING_DOWN))
            return
        if self.error is not None:
            self._say(sid, Failed(f"the engine stopped: {self.error}"))
            return
        waiting = len(self.engine.scheduler.waiting)
        if self.max_waiting is not None and waiting >= self.max_waiting:
            self._say(sid, Busy(f"the server is busy: {waiting} requests are waiting already (--max-waiting "
                                f"{self.max_waiting}); retry later"))
            return
        try:
            requests = self._requests(prompts, sampling, n)
        except ValueError as e:
            self._say(sid, Rejected(str(e), _param_of(str(e))))
            return
        except Exception as e:  # noqa: BLE001 - a bug in checking this request: it alone fails (nothing was added)
            log.exception("checking a request failed")
            self._say(sid, Failed(f"the server failed on this request ({type(e).__name__}: {e}); its log has the "
                                  f"details", status=500))
            return
        for index, req in enumerate(requests):
            self.engine.add(req, stream=stream)
            self._live[req.request_id] = (req, sid, stream, index)
        prompt_tokens = [r.num_prompt for r in requests[::n]]
        self._prompt_tokens += sum(prompt_tokens)
        self._say(sid, Added(prompt_tokens))

    def _requests(self, prompts: list, sampling: dict, n: int) -> list[Request]:
        """The submission's engine requests, all checked before any is added (ValueError names the problem).
        Choice j > 0 of a prompt shares choice 0's prompt pages; with a seed, choice j samples with seed + j."""
        requests = []
        for i, prompt in enumerate(prompts):
            ids, _ = self.engine.prompt_ids(prompt, i)
            params = dict(sampling)
            if params.get("max_tokens") is None:  # a chat's default: all the context the prompt leaves
                params["max_tokens"] = max(1, self.engine.config.max_context - len(ids))
            first = None
            for j in range(n):
                if j and sampling.get("seed") is not None:
                    params["seed"] = (sampling["seed"] + j) % 2**64
                req = self.engine.make_request(ids, SamplingParams(**params), shares_prompt_with=first)
                first = first or req
                requests.append(req)
        return requests

    def _abort(self, sid: int) -> None:
        for rid, (req, s, _, _) in list(self._live.items()):
            if s == sid:
                self.engine.abort(req)
                del self._live[rid]
                self._last_token.pop(rid, None)
                self._ending.pop(rid, None)

    def _abort_all(self, message: str) -> None:
        for sid in {s for _, s, _, _ in self._live.values()}:
            self._say(sid, Failed(message))
        for req, _, _, _ in self._live.values():
            self.engine.abort(req)
        self._live.clear()
        self._last_token.clear()
        self._ending.clear()

    # ------------------------------------------------------------------ steps
    def _step(self) -> None:
        """One engine step, its tokens handed out. If the engine fails, every request is told, and later
        ones are refused (the loop stays, so that every request gets an answer)."""
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine is unusable now: every waiting client hears why
            log.exception("the engine step failed")
            self.error = f"{type(e).__name__}: {e}"
            self._abort_all(f"the engine failed: {self.error}")  # host-side only: pages go back even without a device
            return
        now = time.perf_counter()
        for req, token, _ in events:
            live = self._live.get(req.request_id)
            if live is None:
                continue  # aborted, or not the server's
            _, sid, stream, index = live
            last = self._last_token.get(req.request_id)
            if last is not None:
                self._itl[now - last] += 1
            self._last_token[req.request_id] = now
            done = req.status == FINISHED and not req.unresolved
            if stream:
                entry = req.logprobs[-1] if req.logprobs else None
                self._say(sid, (index, req.detokenizer.stream_delta(done), token, entry))
            if done:
                self._finish(req)
            elif req.status == FINISHED:
                self._ending[req.request_id] = req  # a step in flight still holds a row of it
        for rid, req in list(self._ending.items()):
            if not req.unresolved:  # that row came back (dropped): no token of its own in this step
                del self._ending[rid]
                if rid in self._live:
                    self._finish(req)

    def _finish(self, req: Request) -> None:
        _, sid, stream, index = self._live.pop(req.request_id)
        self._last_token.pop(req.request_id, None)
        self._ending.pop(req.request_id, None)
        self._finished.append((None if req.first_token_time is None else req.first_token_time - req.arrival_time,
                               None if req.finish_time is None else req.finish_time - req.arrival_time,
                               req.num_prompt, req.num_cached_tokens))
        if stream:
            rest = req.detokenizer.stream_delta(True)
            if rest:
                self._say(sid, (index, rest, -1, None))
        self._say(sid, Finished(index, self.engine.output(req)))

    # ------------------------------------------------------------------ messages
    def _say(self, sid: int, event) -> None:
        events = self._outbox.get(sid)
        if events is None:
            self._outbox[sid] = [event]
        else:
            events.append(event)

    def _flush(self) -> None:
        """This turn's events and the Report, in one message."""
        s, st = self.engine.scheduler, self.engine.stats
        m = s.manager
        report = Report(requests=len(self._live), running=len(s.running), waiting=len(s.waiting),
                        kv_used=m.num_pages - m.num_free_pages, kv_free=m.num_free_pages,
                        kv_cached=m.num_cached_pages, preemptions=s.num_preemptions,
                        prompt_tokens=self._prompt_tokens, prompt_tokens_computed=st.prefill_tokens,
                        generated_tokens=st.generated_tokens, drained=not self._accepting and not self._live,
                        error=self.error, itl=dict(self._itl), finished=self._finished)
        self.send(("turn", list(self._outbox.items()), report))
        self._outbox = {}
        self._itl.clear()
        self._finished = []


def _param_of(message: str) -> str | None:
    """The field a ValueError names first (SamplingParams' messages start with it; the prompt's with
    "prompt" or "the prompt"), or None."""
    word = message.removeprefix("the ").split(" ", 1)[0].rstrip(":")
    if word == "prompt":
        return word
    return word if word in SamplingParams.__dataclass_fields__ else None
