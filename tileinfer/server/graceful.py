"""`tileinfer serve`'s uvicorn: SIGTERM or Ctrl-C drains the requests in flight, then the process exits 0.

    forced = serve(app, host="127.0.0.1", port=8000, grace=30.0)   # returns after the stop

uvicorn alone, on SIGINT or SIGTERM, closes its listening sockets at once, waits for open connections
(up to `timeout_graceful_shutdown`), cancels what is left (a streaming client's connection just ends, a
waiting one gets no answer), runs the lifespan shutdown, and then raises the signal again, so that
SIGTERM ends the process with status -15. GracefulServer changes the first signal's meaning:

  1. at once (in the signal handler): the app turns to "stopping" (lifecycle.py): GET /health answers
     503 {"status": "stopping"}, a new request 503 in OpenAI's error shape; the sockets stay open;
  2. the requests in flight run on until they end, for `grace` seconds at most (--shutdown-timeout);
     what is still running then is aborted: a streaming client gets an error chunk and `data: [DONE]`,
     a waiting one a 503;
  3. uvicorn's own shutdown: the sockets close, the last responses are written (RESPONSE_TAIL_SECONDS at
     most), the lifespan shutdown stops the engine process; the signal is not raised again.
A second Ctrl-C during 1-3 aborts what is running at once and skips uvicorn's waiting for connections
(the exit status is then 130); the lifespan shutdown still stops the engine process. A second SIGTERM
changes nothing.
"""
from __future__ import annotations

import signal

import uvicorn

from .lifecycle import Lifecycle

# After the drain, every response has its last event queued: this is only for writing them out to slow
# readers. Connections still open after it are cancelled by uvicorn.
RESPONSE_TAIL_SECONDS = 5.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace: float):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.grace = grace

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's handler of SIGINT and SIGTERM (main thread). Unlike uvicorn's own it does not record
        the signal, which uvicorn would raise again once the shutdown is over."""
        if not self.should_exit:
            self.should_exit = True  # ends uvicorn's main loop; the drain follows it (main_loop below)
            self.lifecycle.stop_accepting()
        elif sig == signal.SIGINT:
            self.force_exit = True

    async def main_loop(self) -> None:
        await super().main_loop()  # until the signal (or should_exit set otherwise)
        await self.lifecycle.drain(self.grace, forced=lambda: self.force_exit)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skips the lifespan shutdown then; the engine is stopped anyway
            await self.lifespan.shutdown()


def serve(app, *, host: str, port: int, grace: float, log_level: str = "info") -> bool:
    """Serve `app` (create_app's) until SIGINT or SIGTERM, then stop as above. True if a second Ctrl-C
    forced the exit. RuntimeError if uvicorn could not start (the port taken: its log says why)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=RESPONSE_TAIL_SECONDS)
    server = GracefulServer(config, app.state.lifecycle, grace)
    try:
        server.run()
    except SystemExit:  # uvicorn's sys.exit(STARTUP_FAILURE): the reason is in its log just above
        raise RuntimeError(f"the server could not start on {host}:{port} (uvicorn's message above says why)"
                           ) from None
    finally:
        app.state.engine.stop()  # done by the lifespan shutdown already, unless start-up failed half-way
    return server.force_exit
