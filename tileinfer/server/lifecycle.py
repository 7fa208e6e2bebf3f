"""Lifecycle: where the server is (loading -> serving -> stopping, what GET /health says) and its drain.

    lifecycle.stop_accepting()          # at the stop signal: /health 503, new requests 503
    await lifecycle.drain(grace)        # requests in flight run on, at most `grace` seconds; the rest aborted

`stop_accepting` is safe to call from a signal handler (an assignment and a reentrant queue put), so the
server says "stopping" the moment the signal arrives. The drain keeps the sockets open: a load balancer
polling /health sees the 503 and a client sending a new request gets a 503 in OpenAI's shape, instead of
a refused connection. A request aborted after the grace ends as any engine failure does: a streaming
client gets an error chunk and `data: [DONE]`, a waiting one a 503.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .engine_client import EngineClient

# uvicorn's server logger: the drain's lines sit between its own "Shutting down" lines.
log = logging.getLogger("uvicorn.error")

POLL_SECONDS = 0.05  # how often the drain looks whether the engine is done


class Lifecycle:
    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.phase = "loading"

    def serving(self) -> None:
        self.phase = "serving"

    def stop_accepting(self) -> None:
        """From now on /health answers 503 "stopping" and new requests 503. Idempotent."""
        self.phase = "stopping"
        self.engine.stop_accepting()

    async def drain(self, grace: float, forced: Callable[[], bool] = lambda: False) -> None:
        """Stop accepting, wait until the requests in flight have ended, for `grace` seconds at most (or
        until `forced()`), then abort those still running."""
        self.stop_accepting()
        if not self.engine.drained.is_set():
            log.info("Stopping: %d request(s) in flight get up to %g s to finish (Ctrl-C again to abort them)",
                     self.engine.num_requests, grace)
        deadline = time.monotonic() + grace
        while not self.engine.drained.is_set() and time.monotonic() < deadline and not forced():
            await asyncio.sleep(POLL_SECONDS)
        if not self.engine.drained.is_set():
            why = "a second Ctrl-C" if forced() else f"the {grace:g} s grace"
            log.warning("Stopping: aborting %d request(s) still running after %s", self.engine.num_requests, why)
            self.engine.abort_all()
