"""Serving a test AG-UI app for tests/http_agents.rs: uvicorn on an ephemeral port of 127.0.0.1,
`READY <port>` on stdout once it listens, and a plain exit on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp


class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a captured SIGTERM after its graceful shutdown, so the process would
        # die by the signal; asking it to exit instead gives the tests a plain exit status 0.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, setattr, self, "should_exit", True)
        yield


async def serve(app: ASGIApp, port: int) -> None:
    # A short graceful shutdown: an open SSE stream (a hanging one too) must not keep SIGTERM
    # waiting.
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    server = Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # startup failed (e.g. port taken): raise its error
            raise SystemExit(1)
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    # READY only once uvicorn is listening, so the test may connect the moment it reads it.
    print(f"READY {bound}", flush=True)
    await task
