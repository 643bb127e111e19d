"""End users: one conversation per connection, sends kept until acked, frames seen once.

Keyed sends are resent until acked, every persistent frame is yielded once across
reconnects, and streamed answers are assembled with each chunk applied once.

::

    created = await mint_conversation("http://127.0.0.1:8080", channel_secret, "alice")
    async with Conversation("ws://127.0.0.1:8080", created.token) as conversation:
        ack = await conversation.send_text("hello")
        async for message in conversation.messages():
            print(message.seq, message.sender, message.text)

Streamed answers, as they are written::

    async for update in conversation.stream_updates():
        print(update.stream_id, update.stream.text, update.stream.status)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from ._connection import (
    FATAL_CLOSE_CODES,
    Disconnect,
    Opened,
    Retry,
    close_of,
    open_session,
    retry_hint_of_error,
    retry_hint_of_reason,
    ws_url,
)
from ._json import JSONObject, as_int, as_object, as_str, dumps, loads_object
from ._shapes import FrameLike, frame_of, is_valid_client_id
from ._tracking import SeqTracker
from .agent import RESEND_TICK, RESENT_CODES
from .backoff import Backoff
from .errors import (
    AckTimeout,
    ClientClosed,
    ConvergerError,
    FatalClose,
    FrameTooLarge,
    GaveUp,
    ServerError,
)
from .frames import (
    FORWARDED_TYPES,
    Ack,
    Catalog,
    ConversationEvent,
    DeliveryStatus,
    ErrorEvent,
    Interrupt,
    Message,
    Participant,
    Presence,
    Reconnected,
    ReplayTruncated,
    RunStatus,
    StreamChunk,
    StreamEnd,
    TokenRefreshed,
    Typing,
    UnknownFrame,
    Welcome,
)
from .streams import StreamAssembly, StreamUpdate

__all__ = ["Conversation", "is_valid_client_id"]

log = logging.getLogger("converger.conversation")

DEFAULT_RETRY_AFTER = 1.0


@dataclass(eq=False)
class _Send:
    client_id: str
    text: str
    future: asyncio.Future[Ack]
    queued: bool  # counts against maxInFlight (message sends; edit/regenerate do not)
    generation: int = -1  # the connection it was last written on
    last_sent: float = 0.0
    retry_at: float | None = None


class Conversation:
    """An end user's connection to one conversation.

    ``url`` is the node's WebSocket endpoint (an ``http://host:port`` base works too) and
    ``token`` a conversation-scope token: bound to a conversation (``mint_conversation`` gives
    one), or unbound with ``conversation_id`` (an existing conversation of the token's user) or
    without (a new conversation is created; ``user_id`` names its user when the token has
    none). ``watermark`` is the highest seq already seen (0: nothing): what follows is replayed.

    The client reconnects by itself (full-jitter ``backoff``, honouring ``retryAfterMs``;
    never after 4400, 4401, 4403 or 1009) with the watermark so far, resends every unacked
    send with its clientId (an already stored send is acked with ``duplicate=True``), and
    yields every persistent frame once from :meth:`messages`, de-duplicated by seq. Frames
    this client sent itself are answered by the :class:`~converger.Ack` that :meth:`send`
    returns and are not yielded again; frames of the same user sent from elsewhere are.

    Streamed answers (``streamChunk``, ``streamEnd``) are assembled in :attr:`streams`, kept
    across reconnects, so the chunks a new connection is shown again are applied once;
    :meth:`stream_updates` yields each applied chunk and each stream's end. ``max_events``
    bounds both the unread :meth:`events` and the unread :meth:`stream_updates` (the oldest
    go first; :attr:`streams` always holds everything).
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        conversation_id: str | None = None,
        user_id: str | None = None,
        watermark: int = 0,
        backoff: Backoff | None = None,
        resend_interval: float = 5.0,
        open_timeout: float = 10.0,
        max_events: int = 1000,
    ) -> None:
        self._url = ws_url(url)
        self._token = token
        self._conversation_id = conversation_id
        self._user_id = user_id
        self._tracker = SeqTracker(watermark)
        self._backoff = backoff or Backoff()
        self._resend_interval = resend_interval
        self._open_timeout = open_timeout
        self._outbox: OrderedDict[str, _Send] = OrderedDict()
        self._outbox_empty = asyncio.Event()
        self._outbox_empty.set()
        self._messages: asyncio.Queue[Message | None] = asyncio.Queue()
        self._events: asyncio.Queue[ConversationEvent | None] = asyncio.Queue(
            maxsize=max(max_events, 1)
        )
        self._streams = StreamAssembly()
        self._stream_updates: asyncio.Queue[StreamUpdate | None] = asyncio.Queue(
            maxsize=max(max_events, 1)
        )
        self._ws: ClientConnection | None = None
        self._welcome: Welcome | None = None
        self._generation = 0
        self._connections = 0
        self._changed = asyncio.Event()  # replaced after each change of connection state
        self._supervisor: asyncio.Task[None] | None = None
        self._resender: asyncio.Task[None] | None = None
        self._fatal: ConvergerError | None = None
        self._last_error: ServerError | None = None
        self._last_hint: float | None = None
        self._last_disconnect: Disconnect | None = None
        self._connected_at: float | None = None
        self._closed = False
        self._close_started: asyncio.Future[None] | None = None

    @classmethod
    async def open(cls, url: str, token: str, **options: Any) -> Conversation:
        """Creates a client with ``options`` (as for the constructor) and connects it."""
        conversation = cls(url, token, **options)
        await conversation.connect()
        return conversation

    # --- state -------------------------------------------------------------------------

    @property
    def welcome(self) -> Welcome:
        """The latest ``welcome`` (replaced on every reconnect)."""
        if self._welcome is None:
            raise RuntimeError("the conversation is not connected yet")
        return self._welcome

    @property
    def conversation_id(self) -> str | None:
        """The conversation this client is in (known after the first ``welcome``)."""
        return self._conversation_id

    @property
    def user_id(self) -> str | None:
        """The conversation's user."""
        return self._welcome.user_id if self._welcome else self._user_id

    @property
    def watermark(self) -> int:
        """The highest seq with nothing missing below it; store it to resume later."""
        return self._tracker.watermark

    @property
    def pending_interrupts(self) -> list[Interrupt]:
        """Open interrupts as of the latest ``welcome`` (``welcome.data.pending``)."""
        return list(self._welcome.pending) if self._welcome else []

    @property
    def streams(self) -> StreamAssembly:
        """The conversation's streamed answers as assembled so far, across reconnects."""
        return self._streams

    @property
    def last_disconnect(self) -> Disconnect | None:
        """How the last connection ended (``None`` while the first one is open)."""
        return self._last_disconnect

    @property
    def connected_at(self) -> float | None:
        """The event loop's clock when the current connection was welcomed."""
        return self._connected_at

    @property
    def connected(self) -> bool:
        """Whether a welcomed connection is open right now."""
        return self._ws is not None

    @property
    def connections(self) -> int:
        """How many connections were welcomed so far (1 after :meth:`connect`)."""
        return self._connections

    @property
    def unacked(self) -> list[str]:
        """ClientIds of the sends still waiting for an ack, in send order."""
        return list(self._outbox)

    async def wait_connected(
        self, timeout: float | None = None, *, connections: int = 1
    ) -> Welcome:
        """Waits until a connection is open and at least ``connections`` were welcomed so far.

        Returns at once when that already holds; ``connections=self.connections + 1`` waits
        for the next reconnect.
        """
        async with asyncio.timeout(timeout):
            while self._ws is None or self._connections < connections:
                if self._fatal is not None:
                    raise self._fatal
                if self._closed:
                    raise ClientClosed("the conversation is closed")
                await self._changed.wait()
        return self.welcome

    # --- lifecycle ---------------------------------------------------------------------

    async def connect(self) -> Welcome:
        """Opens the first connection (one attempt); later ones are made in the background.

        Raises :class:`FatalClose` when the node refuses the hello for good and
        :class:`GaveUp` when it cannot be reached.
        """
        if self._closed:
            raise ClientClosed("the conversation is closed")
        if self._supervisor is not None:
            return self.welcome
        try:
            opened = await open_session(self._url, self._hello(), self._open_timeout)
        except Retry as failure:
            raise GaveUp(1, failure) from None
        await self._attach(opened)
        self._supervisor = asyncio.create_task(self._supervise(), name="converger-conversation")
        self._resender = asyncio.create_task(self._resend_loop(), name="converger-resend")
        return self.welcome

    async def __aenter__(self) -> Conversation:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self, timeout: float = 5.0) -> None:
        """Waits up to ``timeout`` seconds for unacked sends, then closes (1000).

        Sends still unacked then fail with :class:`ClientClosed`; the iterators end.
        """
        if self._close_started is not None:
            await asyncio.shield(self._close_started)
            return
        self._close_started = asyncio.get_running_loop().create_future()
        try:
            await self._close_once(timeout)
        finally:
            self._close_started.set_result(None)

    async def _close_once(self, timeout: float) -> None:
        if self._outbox and self._fatal is None and self._supervisor is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(timeout, 0.0)):
                    await self._outbox_empty.wait()
        self._closed = True
        ws = self._ws
        self._detach()
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close(1000)
        current = asyncio.current_task()
        for task in (self._resender, self._supervisor):
            if task is not None and task is not current and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._fail_outbox(ClientClosed("the conversation was closed before the server answered"))
        self._end_iterators()

    # --- reading -----------------------------------------------------------------------

    async def messages(self) -> AsyncIterator[Message]:
        """Every persistent frame of the conversation once, across reconnects, until closed.

        Frames come in the order they arrive (seq order, except that live frames that follow
        a truncated replay come before the gap is filled). Raises :class:`FatalClose` or
        :class:`GaveUp` at the end when the connection stopped for good.
        """
        while True:
            item = await self._messages.get()
            if item is None:
                self._messages.put_nowait(None)
                if self._fatal is not None:
                    raise self._fatal
                return
            yield item

    def __aiter__(self) -> AsyncIterator[Message]:
        return self.messages()

    async def next_message(self, timeout: float | None = None) -> Message:
        """The next persistent frame (see :meth:`messages`); :class:`ClientClosed` at the end."""
        async with asyncio.timeout(timeout):
            item = await self._messages.get()
        if item is None:
            self._messages.put_nowait(None)
            if self._fatal is not None:
                raise self._fatal
            raise ClientClosed("the conversation is closed")
        return item

    async def stream_updates(self) -> AsyncIterator[StreamUpdate]:
        """Streamed answers as they arrive: each chunk applied once, then each stream's end.

        Every update names its stream's :class:`~converger.AssembledStream` (the text so far,
        the status). A chunk a reconnect shows again produces no update; a stream produces
        one update with ``end``, from its ``streamEnd`` or from the stored answer that names
        it, whichever arrives first. Ends when the conversation closes.
        """
        while True:
            item = await self._stream_updates.get()
            if item is None:
                self._stream_updates.put_nowait(None)
                return
            yield item

    async def events(self) -> AsyncIterator[ConversationEvent]:
        """Transient frames and connection events, typed (see :data:`ConversationEvent`).

        At most ``max_events`` are kept while nobody reads them (the oldest go first).
        """
        while True:
            item = await self._events.get()
            if item is None:
                self._events.put_nowait(None)
                return
            yield item

    # --- sending -----------------------------------------------------------------------

    async def send(
        self,
        frame: FrameLike,
        *,
        client_id: str | None = None,
        timeout: float | None = 60.0,
    ) -> Ack:
        """Stores a message frame (``text``, ``event``, any type with ``data``) as the user.

        The frame gets ``client_id`` (else its own ``clientId``, else a fresh one) and is
        resent with it, across reconnects, until the server acks it; retryable refusals
        (``too_many_in_flight``, ``rate_limited``, ``internal``) are resent after their
        ``retryAfterMs``. Returns the ack (``seq``, ``id``, ``duplicate``); raises
        :class:`ServerError` for a refusal, :class:`AckTimeout` after ``timeout`` seconds
        (``None``: no limit).
        """
        body = frame_of(frame)
        key = client_id or as_str(body.get("clientId")) or f"c-{uuid4().hex}"
        body["clientId"] = key
        return await self._submit(key, body, queued=True, timeout=timeout)

    async def send_text(
        self,
        text: str,
        *,
        client_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        turn_policy: str | None = None,
        timeout: float | None = 60.0,
    ) -> Ack:
        """Sends a ``text`` message (see :meth:`send`).

        ``turn_policy`` (``"interrupt"``, …) asks for another policy than the channel's for this
        send, where the channel allows it (``docs/protocol.md`` §3.10); under ``reject`` a send
        while a turn runs raises :class:`TurnInProgress`.
        """
        frame: JSONObject = {"type": "text", "data": {"text": text}}
        if metadata is not None:
            frame["metadata"] = dict(metadata)
        if turn_policy is not None:
            frame["turnPolicy"] = turn_policy
        return await self.send(frame, client_id=client_id, timeout=timeout)

    async def edit(
        self,
        data: str | Mapping[str, Any],
        *,
        seq: int | None = None,
        message_id: str | None = None,
        client_id: str | None = None,
        timeout: float | None = 60.0,
    ) -> Ack:
        """Edits one of the user's turns (``seq``, else ``message_id``, else the latest).

        ``data`` is the new ``data`` (a string means ``{"text": …}``). Agents get a new
        revision of the turn. The ack's ``turn`` names it, ``seq`` is the edit frame's.
        """
        body: JSONObject = {
            "type": "edit",
            "data": {"text": data} if isinstance(data, str) else dict(data),
        }
        if seq is not None:
            body["seq"] = seq
        if message_id is not None:
            body["messageId"] = message_id
        key = client_id or f"e-{uuid4().hex}"
        body["clientId"] = key
        return await self._submit(key, body, queued=False, timeout=timeout)

    async def regenerate(
        self,
        *,
        seq: int | None = None,
        message_id: str | None = None,
        client_id: str | None = None,
        timeout: float | None = 60.0,
    ) -> Ack:
        """Asks for another answer to a turn (``seq``, else ``message_id``, else the latest).

        The ack's ``turn`` names the new revision; nothing is stored until an agent answers.
        """
        body: JSONObject = {"type": "regenerate"}
        if seq is not None:
            body["seq"] = seq
        if message_id is not None:
            body["messageId"] = message_id
        key = client_id or f"g-{uuid4().hex}"
        body["clientId"] = key
        return await self._submit(key, body, queued=False, timeout=timeout)

    async def typing(self, is_typing: bool = True) -> bool:
        """Tells the agents whether the user types (transient; false when not written)."""
        return await self._write(dumps({"type": "typing", "isTyping": is_typing}))

    async def read(self, watermark: int | None = None) -> bool:
        """Stores the user's read position (default: :attr:`watermark`); transient, no answer."""
        position = self._tracker.watermark if watermark is None else watermark
        return await self._write(dumps({"type": "read", "watermark": position}))

    async def forward(
        self,
        frame_type: str,
        data: Mapping[str, Any] | None = None,
        *,
        client_id: str | None = None,
        timeout: float | None = 10.0,
    ) -> str:
        """Hands a frame to the channel's agents (transient, not stored).

        ``frame_type`` is ``resume``, ``abort``, ``genui_event``, ``client_tools``,
        ``client_skills`` or ``survey``.
        Waits up to ``timeout`` seconds for a connection, then writes the frame once and
        returns its clientId. There is no answer on success; when no agent is connected the
        server answers ``bot_unavailable``, which :meth:`events` yields as an
        :class:`~converger.ErrorEvent` with this clientId.
        """
        if frame_type not in FORWARDED_TYPES:
            raise ValueError(f"{frame_type!r} is not a forwarded frame type")
        key = client_id or f"f-{uuid4().hex}"
        await self.wait_connected(timeout)
        frame = {"type": frame_type, "clientId": key, "data": dict(data or {})}
        await self._write(dumps(frame))
        return key

    async def resume(self, data: Mapping[str, Any], *, client_id: str | None = None) -> str:
        """Forwards a ``resume`` (the answer to an interrupt) to the agents; see :meth:`forward`."""
        return await self.forward("resume", data, client_id=client_id)

    async def abort(
        self, data: Mapping[str, Any] | None = None, *, client_id: str | None = None
    ) -> str:
        """Forwards an ``abort`` to the agents; see :meth:`forward`."""
        return await self.forward("abort", data, client_id=client_id)

    async def refresh_token(self, token: str) -> bool:
        """Uses ``token`` from now on: sent as ``auth`` now and in later hellos."""
        self._token = token
        return await self._write(dumps({"type": "auth", "token": token}))

    async def _submit(
        self, client_id: str, body: JSONObject, *, queued: bool, timeout: float | None
    ) -> Ack:
        if not is_valid_client_id(client_id):
            raise ValueError(f"invalid clientId {client_id!r} (1-128 of A-Za-z0-9._:~-)")
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise ClientClosed("the conversation is closed")
        text = dumps(body)
        limit = self._welcome.limits.max_frame_bytes if self._welcome else None
        size = len(text.encode())
        if limit is not None and size > limit:
            raise FrameTooLarge(size, limit)
        entry = self._outbox.get(client_id)
        if entry is None:
            future: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
            future.add_done_callback(_consume)
            entry = _Send(client_id, text, future, queued)
            self._outbox[client_id] = entry
            self._outbox_empty.clear()
            await self._pump()
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(entry.future)
        except TimeoutError:
            if not entry.future.done():
                self._settle(client_id)
                raise AckTimeout(client_id, timeout or 0.0) from None
            raise

    async def _pump(self) -> None:
        """Writes the sends not yet on the current connection, within ``maxInFlight``."""
        if self._ws is None:
            return
        loop = asyncio.get_running_loop()
        limit = self._welcome.limits.max_in_flight if self._welcome else 32
        in_flight = sum(
            1 for e in self._outbox.values() if e.queued and e.generation == self._generation
        )
        for entry in list(self._outbox.values()):
            if entry.generation == self._generation:
                continue
            if entry.retry_at is not None and loop.time() < entry.retry_at:
                continue
            if entry.queued:
                if in_flight >= limit:
                    break
                in_flight += 1
            await self._transmit(entry)

    async def _transmit(self, entry: _Send) -> None:
        entry.generation = self._generation
        entry.retry_at = None
        entry.last_sent = asyncio.get_running_loop().time()
        await self._write(entry.text)

    async def _write(self, text: str) -> bool:
        ws = self._ws
        if ws is None:
            return False
        try:
            await ws.send(text)
        except ConnectionClosed:
            return False
        return True

    def _settle(self, client_id: str) -> _Send | None:
        entry = self._outbox.pop(client_id, None)
        if not self._outbox:
            self._outbox_empty.set()
        return entry

    def _fail_outbox(self, error: BaseException) -> None:
        for client_id in list(self._outbox):
            entry = self._settle(client_id)
            if entry is not None and not entry.future.done():
                entry.future.set_exception(error)

    async def _resend_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(RESEND_TICK)
            if self._ws is None:
                continue
            now = loop.time()
            for entry in list(self._outbox.values()):
                stale = (
                    entry.generation == self._generation
                    and now - entry.last_sent >= self._resend_interval
                )
                if stale and self._outbox.get(entry.client_id) is entry:
                    await self._transmit(entry)
            await self._pump()

    # --- connection --------------------------------------------------------------------

    def _hello(self) -> JSONObject:
        hello: JSONObject = {
            "type": "hello",
            "protocol": "converger/1",
            "token": self._token,
            "watermark": self._tracker.watermark,
        }
        if self._conversation_id is not None:
            hello["conversationId"] = self._conversation_id
        if self._user_id is not None:
            hello["userId"] = self._user_id
        return hello

    async def _attach(self, opened: Opened) -> None:
        welcome = Welcome.parse(opened.welcome)
        asked = self._conversation_id
        if asked is not None and welcome.conversation_id != asked:
            self._tracker.reset(0)  # another conversation: its seqs are not ours
        if welcome.watermark is not None and self._tracker.watermark > welcome.watermark:
            self._tracker.reset(welcome.watermark)  # refused as invalid_watermark; live after it
        reconnected = self._welcome is not None
        self._welcome = welcome
        if welcome.conversation_id is not None:
            self._conversation_id = welcome.conversation_id
        self._ws = opened.ws
        self._generation += 1
        self._connections += 1
        self._connected_at = asyncio.get_running_loop().time()
        self._last_error = None
        self._last_hint = None
        log.info("conversation %s connected at watermark %d", self._conversation_id, self.watermark)
        if reconnected:
            self._emit(Reconnected(welcome))
        for message in opened.early:
            await self._on_message(message)
        self._notify()
        await self._pump()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _detach(self) -> None:
        self._ws = None
        self._notify()

    async def _supervise(self) -> None:
        try:
            while True:
                ws = self._ws
                if ws is None:
                    return
                hint = await self._read(ws)
                self._detach()
                if self._closed:
                    return
                await self._reconnect(hint)
        except (FatalClose, GaveUp) as error:
            log.error("conversation stopped: %s", error)
            self._stop_for_good(error)
        except Exception as error:  # a bug: stop loudly rather than hang
            log.exception("conversation connection loop failed")
            self._stop_for_good(ConvergerError(f"the connection loop failed: {error!r}"))

    def _stop_for_good(self, error: ConvergerError) -> None:
        self._fatal = error
        self._detach()
        self._fail_outbox(error)
        self._notify()
        self._end_iterators()

    async def _read(self, ws: ClientConnection) -> float | None:
        try:
            async for text in ws:
                message = loads_object(text)
                if message is None:
                    continue
                try:
                    await self._on_message(message)
                except Exception:
                    log.exception("could not handle %s", str(message)[:200])
        except ConnectionClosed:
            pass
        if self._closed:
            return None
        code, reason = close_of(ws)
        if code in FATAL_CLOSE_CODES:
            raise FatalClose(code, reason, self._last_error)
        hint = retry_hint_of_reason(reason)
        if hint is None:
            hint = self._last_hint
        self._last_disconnect = Disconnect(code, reason, hint, asyncio.get_running_loop().time())
        if code is None:
            log.warning("conversation connection lost; reconnecting")
        else:
            log.warning("conversation disconnected (%s %s); reconnecting", code, reason)
        return hint

    async def _reconnect(self, hint: float | None) -> None:
        attempt = 0
        while True:
            await asyncio.sleep(self._backoff.delay(attempt, hint))
            try:
                opened = await open_session(self._url, self._hello(), self._open_timeout)
            except Retry as failure:
                attempt += 1
                hint = failure.retry_after
                log.warning("conversation reconnect attempt %d failed: %s", attempt, failure)
                if self._backoff.exhausted(attempt):
                    raise GaveUp(attempt, failure) from None
                continue
            if self._closed:
                await opened.ws.close()
                return
            await self._attach(opened)
            return

    def _end_iterators(self) -> None:
        self._messages.put_nowait(None)
        self._emit(None)
        self._emit_update(None)

    def _emit(self, event: ConversationEvent | None) -> None:
        while True:
            try:
                self._events.put_nowait(event)
                return
            except asyncio.QueueFull:
                self._events.get_nowait()  # drop the oldest event nobody read

    def _emit_update(self, update: StreamUpdate | None) -> None:
        while True:
            try:
                self._stream_updates.put_nowait(update)
                return
            except asyncio.QueueFull:
                self._stream_updates.get_nowait()  # drop the oldest update nobody read

    # --- receiving ---------------------------------------------------------------------

    async def _on_message(self, frame: JSONObject) -> None:
        kind = as_str(frame.get("type")) or ""
        message = Message.parse(frame)
        if message is not None:
            await self._on_persistent(message)
        elif kind == "ack":
            await self._on_ack(Ack.parse(frame))
        elif kind == "error":
            await self._on_error(as_object(frame.get("data")))
        elif kind == "replayTruncated":
            data = as_object(frame.get("data"))
            self._emit(
                ReplayTruncated(as_int(data.get("watermark")), as_int(data.get("headSeq")), frame)
            )
            await self._sync()
        elif kind == "heartbeat":
            if self._tracker.has_gap:
                await self._sync()
        elif kind == "typing":
            self._emit(
                Typing(frame.get("isTyping") is True, Participant.parse(frame.get("sender")), frame)
            )
        elif kind == "run":
            self._emit(RunStatus(as_object(frame.get("data")), frame))
        elif kind == "deliveryStatus":
            data = as_object(frame.get("data"))
            self._emit(
                DeliveryStatus(
                    as_int(data.get("upToSeq")),
                    as_str(data.get("status")),
                    Participant.parse(data.get("by")),
                    frame,
                )
            )
        elif kind == "presence":
            data = as_object(frame.get("data"))
            self._emit(
                Presence(
                    Participant.parse(data.get("participant")),
                    as_str(data.get("status")),
                    as_int(data.get("connections")),
                    frame,
                )
            )
        elif kind in ("genui_components", "skills"):
            self._emit(
                Catalog(
                    "skills" if kind == "skills" else "genui_components",
                    as_str(frame.get("hash")),
                    frame.get("unchanged") is True,
                    frame,
                )
            )
        elif kind == "streamChunk":
            chunk = StreamChunk.parse(frame)
            if chunk is None:
                self._emit(UnknownFrame(frame))
                return
            stream = self._streams.apply_chunk(chunk)
            if stream is not None:
                self._emit_update(StreamUpdate(stream, chunk=chunk))
        elif kind == "streamEnd":
            end = StreamEnd.parse(frame)
            if end is None:
                self._emit(UnknownFrame(frame))
                return
            stream = self._streams.apply_end(end)
            if stream is not None:
                self._emit_update(StreamUpdate(stream, end=end))
        elif kind == "tokenRefreshed":
            self._emit(TokenRefreshed(as_int(as_object(frame.get("data")).get("expiresAt")), frame))
        elif kind != "welcome":
            self._emit(UnknownFrame(frame))

    async def _on_persistent(self, message: Message) -> None:
        entry = self._outbox.get(message.client_id) if message.client_id else None
        if entry is not None:
            # Our own send, replayed after a reconnect that lost its ack: it is stored.
            self._tracker.observe(message.seq)
            ack = Ack(message.client_id, message.id, message.seq, message.timestamp, True, None, {})
            self._settle(entry.client_id)
            if not entry.future.done():
                entry.future.set_result(ack)
            await self._pump()
            return
        if self._tracker.observe(message.seq):
            self._messages.put_nowait(message)
            stream = self._streams.apply_message(message)
            if stream is not None:
                end = StreamEnd(stream.stream_id, "committed", None, message.raw)
                self._emit_update(StreamUpdate(stream, end=end))

    async def _on_ack(self, ack: Ack) -> None:
        if ack.seq is not None:
            self._tracker.observe(ack.seq)
        if ack.client_id is None:
            return
        entry = self._settle(ack.client_id)
        if entry is not None and not entry.future.done():
            entry.future.set_result(ack)
        await self._pump()

    async def _on_error(self, data: JSONObject) -> None:
        error = ServerError.from_data(data)
        entry = self._outbox.get(error.client_id) if error.client_id else None
        loop = asyncio.get_running_loop()
        if entry is not None:
            if error.code in RESENT_CODES:
                entry.generation = -1
                entry.retry_at = loop.time() + (retry_hint_of_error(data) or DEFAULT_RETRY_AFTER)
                return
            self._settle(entry.client_id)
            if not entry.future.done():
                entry.future.set_exception(error)
            await self._pump()
            return
        hint = retry_hint_of_error(data)
        if error.code == "rate_limited":
            # The dropped frame is not named: send again whatever is waiting, a bit later.
            for waiting in self._outbox.values():
                waiting.generation = -1
                waiting.retry_at = loop.time() + (hint or DEFAULT_RETRY_AFTER)
        elif error.client_id is None:
            self._last_error = error
            if hint is not None:
                self._last_hint = hint
        self._emit(ErrorEvent(error, {"type": "error", "data": data}))

    async def _sync(self) -> None:
        await self._write(dumps({"type": "sync", "watermark": self._tracker.watermark}))


def _consume(future: asyncio.Future[Ack]) -> None:
    """Marks a settled future's exception as retrieved (its waiter may be gone)."""
    if not future.cancelled():
        future.exception()
