"""What the examples share: waiting for the node, which may not be up yet when they start.

A first ``cargo run -p converger-cli -- serve`` builds the gateway for minutes before the node
listens. Each example calls :func:`wait_for_node` with its ``CONVERGER_URL`` before it
connects: that polls the node's ``GET /health/ready`` every second until it answers 200, says
once on stderr what it is waiting for, and gives up with a message after 10 minutes. Without
``CONVERGER_AGENT_TOKEN``, ``llm_agent.py`` then reads the admin token that the node generated
in the repository's ``.converger/admin_token`` with :func:`read_admin_token`. The node writes
that file before it listens, so a node started in the repository root has it once it is ready.
The examples read ``CONVERGER_AGENT_GROUP`` themselves; this module does not.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

WAIT_SECONDS = 600.0
"""How long to wait for the node: the first build of the gateway takes several minutes."""
POLL_SECONDS = 1.0
"""The pause between two readiness checks."""
START_HINT = "start it with `cargo run -p converger-cli -- serve` in the repository root"
ADMIN_TOKEN_FILE = Path(__file__).resolve().parent.parent.parent.parent / ".converger/admin_token"
"""The admin token a node started in the repository root generates (unless configured)."""


def http_origin(url: str) -> str:
    """The node's HTTP origin for ``url``: ``ws://host:port/…`` gives ``http://host:port``."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "", "", ""))


async def not_ready(http: httpx.AsyncClient) -> str | None:
    """Why the node is not ready yet, or ``None`` once ``GET /health/ready`` answers 200."""
    try:
        response = await http.get("/health/ready")
    except httpx.TransportError as error:
        return f"{type(error).__name__}: {error}"
    if response.status_code != httpx.codes.OK:
        return f"GET /health/ready answered {response.status_code}"
    return None


async def wait_for_node(url: str, timeout: float = WAIT_SECONDS) -> None:
    """Returns once the node at ``url`` is ready; exits the program after ``timeout`` seconds."""
    origin = http_origin(url)
    deadline = time.monotonic() + timeout
    waiting = False
    async with httpx.AsyncClient(base_url=origin, timeout=5.0) as http:
        while (reason := await not_ready(http)) is not None:
            if time.monotonic() >= deadline:
                raise SystemExit(
                    f"the node at {origin} is not ready after {timeout:.0f} s ({reason}); "
                    f"{START_HINT}"
                )
            if not waiting:
                print(f"waiting for the node at {origin} ({START_HINT})…", file=sys.stderr)
                waiting = True
            await asyncio.sleep(POLL_SECONDS)
    if waiting:
        print(f"the node at {origin} answers", file=sys.stderr)


async def read_admin_token(path: Path = ADMIN_TOKEN_FILE) -> str:
    """The admin token the development node generated; exits the program when there is none."""
    try:
        return (await asyncio.to_thread(path.read_text)).strip()
    except FileNotFoundError:
        raise SystemExit(
            f"the node answers, but {path} does not exist: it was not started in the repository "
            "root, or admin_token is configured; set CONVERGER_AGENT_TOKEN to a channel-scope "
            f"token instead, or {START_HINT}"
        ) from None
