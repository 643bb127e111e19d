"""One WebSocket connection: the upgrade, ``hello`` / ``welcome``, and reading a close (private).

Both clients (agents and end users) share this; the reconnect loops live in each client.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from ._json import JSONObject, as_int, as_object, as_str, dumps, loads_object
from .errors import FatalClose, ServerError

SOCKET_PATH = "/socket/converger/v1"
SUBPROTOCOL = Subprotocol("converger.v1")
FATAL_CLOSE_CODES = frozenset({4400, 4401, 4403, 1009})
"""Closes a new connection would get again: protocol, auth, inactive channel, too big."""
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

log = logging.getLogger("converger")


def ws_url(url: str) -> str:
    """The WebSocket endpoint for ``url``.

    ``http://host:port`` (or ``https``) becomes ``ws://host:port/socket/converger/v1``; a
    ``ws``/``wss`` URL without a path gets the path too; anything else is kept as given.
    """
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path
    if path in ("", "/"):
        path = SOCKET_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, parts.fragment))


class Retry(Exception):
    """A connection failed in a way a new connection may fix (private)."""

    def __init__(self, cause: str, retry_after: float | None = None) -> None:
        self.cause = cause
        self.retry_after = retry_after
        super().__init__(cause)


@dataclass(frozen=True, slots=True)
class Disconnect:
    """How the last connection ended.

    ``code`` and ``reason`` are the close the server sent (``None`` and ``""`` when the
    connection was lost without a close frame), ``retry_after`` the server's hint in seconds
    (from the JSON close reason or the ``error`` before it), and ``at`` the event loop's clock
    when the client noticed.
    """

    code: int | None
    reason: str
    retry_after: float | None
    at: float


@dataclass
class Opened:
    """A welcomed connection."""

    ws: ClientConnection
    welcome: JSONObject
    early: list[JSONObject] = field(default_factory=list)


def retry_hint_of_reason(reason: str) -> float | None:
    """``retryAfterMs`` of a JSON close reason (1012, 4503), in seconds."""
    if not reason.startswith("{"):
        return None
    try:
        parsed = json.loads(reason)
    except ValueError:
        return None
    millis = as_int(as_object(parsed).get("retryAfterMs"))
    return None if millis is None else millis / 1000


def retry_hint_of_error(data: JSONObject) -> float | None:
    """``retryAfterMs`` of an error frame's data, in seconds."""
    millis = as_int(data.get("retryAfterMs"))
    return None if millis is None else millis / 1000


def close_of(ws: ClientConnection) -> tuple[int | None, str]:
    """The close code and reason the server sent, ``(None, "")`` when it sent none."""
    received = ws.protocol.close_rcvd
    if received is None:
        return None, ""
    return received.code, received.reason


async def open_session(url: str, hello: JSONObject, open_timeout: float) -> Opened:
    """Upgrades, sends ``hello`` and waits for ``welcome``.

    Raises :class:`FatalClose` for refusals a new attempt would meet again and
    :class:`Retry` (with the server's delay hint, when it gave one) for the others.
    """
    try:
        ws = await connect(
            url,
            subprotocols=[SUBPROTOCOL],
            open_timeout=open_timeout,
            max_size=MAX_MESSAGE_BYTES,
            close_timeout=2,
            compression=None,
        )
    except InvalidStatus as refused:
        status = refused.response.status_code
        header = refused.response.headers.get("Retry-After")
        retry_after: float | None = None
        if header is not None:
            try:
                retry_after = float(header)
            except ValueError:
                retry_after = None
        if 400 <= status < 500 and status not in (408, 429):
            body = refused.response.body or b""
            raise FatalClose(None, body.decode(errors="replace"), http_status=status) from None
        raise Retry(f"upgrade refused with HTTP {status}", retry_after) from None
    except (OSError, TimeoutError, InvalidHandshake) as error:
        raise Retry(f"cannot connect: {error!r}") from None
    refusal: ServerError | None = None
    early: list[JSONObject] = []
    try:
        await ws.send(dumps(hello))
        async with asyncio.timeout(open_timeout):
            while True:
                text = await ws.recv()
                message = loads_object(text)
                if message is None:
                    continue
                kind = as_str(message.get("type"))
                if kind == "welcome":
                    return Opened(ws, as_object(message.get("data")), early)
                if kind == "error" and "conversationId" not in message:
                    refusal = ServerError.from_data(message.get("data"))
                    continue
                early.append(message)
    except ConnectionClosed:
        code, reason = close_of(ws)
        if code in FATAL_CLOSE_CODES:
            raise FatalClose(code, reason, refusal) from None
        hint = retry_hint_of_reason(reason)
        if hint is None and refusal is not None:
            hint = retry_hint_of_error(refusal.data)
        raise Retry(f"closed during the handshake: {code} {reason}", hint) from None
    except TimeoutError:
        await ws.close()
        raise Retry("no welcome in time") from None
    except BaseException:
        await ws.close()
        raise
