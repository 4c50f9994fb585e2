"""The HTTP server's process: uvicorn's server with this server's ends (serve/server.py's docstring,
"Faults"): the first SIGINT or SIGTERM drains open requests, a second exits at once, and the engine's
death ends the server with status 1 so that its supervisor restarts it."""

import os
import signal
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from .server import Server

# uvicorn's own bound on a graceful shutdown, past the server's: requests cut at the end of the
# grace period still need a moment to send their last event.
SHUTDOWN_MARGIN_S = 5.0
# How long an idle keep-alive connection stays open. Clients drop a pooled connection after their
# own idle time (httpx and so the openai client: 5 s, uvicorn's default too): with the two equal, a
# client reusing a connection just as the server closes it loses that request (httpx's ReadError).
# Longer here, the client always lets go first.
KEEP_ALIVE_S = 30.0


class HTTPServer(uvicorn.Server):
    """uvicorn's server with this server's ends (see the module docstring): signals drain it, a dead
    engine ends it. `say` prints one line for the user; after run(), `death` is how the engine
    died, if it did (the server then exits with status 1)."""

    def __init__(self, app: FastAPI, host: str, port: int, shutdown_timeout_s: float, say: Callable[[str], None]):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S,
                                        timeout_graceful_shutdown=shutdown_timeout_s + SHUTDOWN_MARGIN_S))
        self.state: Server = app.state.server
        self.state.on_fatal = self.engine_died
        self.shutdown_timeout_s, self.say = shutdown_timeout_s, say
        self.stopping = False
        self.death: str | None = None

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler (SIGINT, SIGTERM), in place of its own: the first drains, the
        second exits at once. uvicorn's would also raise the signal again once it has stopped, and
        a second Ctrl-C would end the process in tracebacks."""
        name, n = signal.Signals(sig).name, len(self.state.open)
        requests = f"{n} open request{'s' if n != 1 else ''}"
        if self.stopping:
            self.state.engine.kill()
            self.say(f"second {name}: stopped at once, {requests} cut off")
            os._exit(128 + sig)
        self.stopping = True
        self.should_exit = True  # first, then the line: saying it must not be what stops the stop
        self.state.drain_soon(self.shutdown_timeout_s)
        self.say(f"{name}: shutting down; {requests} {'gets' if n == 1 else 'get'} up to {self.shutdown_timeout_s:g} s "
                 f"to finish (a second {name} stops at once)")

    def engine_died(self, reason: str) -> None:  # the loop
        self.death = reason
        self.should_exit = True
