"""Agents: a channel-scope connection in a group, typed turns, and replies resent until acked.

An :class:`Agent` holds one WebSocket to a node and serves the conversations of one channel
(``docs/agents.md``). It reconnects by itself (full-jitter backoff, honouring the server's
``retryAfterMs``; never after 4400, 4401, 4403 or 1009), asks for what it missed with
``hello.watermarks``, resends every unacknowledged reply with the same clientId after a
reconnect, and hands each turn delivery to the application once.

Handler style::

    agent = Agent("ws://127.0.0.1:8080", token, group="echo")

    @agent.turn
    async def answer(turn: Turn) -> None:
        await turn.reply(f"echo: {turn.text}")

    await agent.run(concurrency=4)

Iterator style::

    async with Agent(url, token, group="echo") as agent:
        async for turn in agent.turns():
            await turn.reply(f"echo: {turn.text}")

Streamed answers (``turn.stream()``, see :class:`~converger.AnswerStream`)::

    async with turn.stream() as stream:
        for word in words:
            await stream.text(word)
    # leaving the block commits the streamed text as the turn's answer
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID, uuid4

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
from ._shapes import FrameLike, frame_of, frames_of, is_valid_client_id
from ._tracking import REMEMBERED_CONVERSATIONS, ChannelTracker
from .backoff import Backoff
from .errors import (
    AckTimeout,
    ClientClosed,
    ConvergerError,
    FatalClose,
    FrameTooLarge,
    GaveUp,
    LeaseLost,
    ServerError,
    StaleRuntime,
    StreamClosed,
    StreamInterrupted,
    TurnConflict,
    TurnStopped,
    TurnSuperseded,
)
from .frames import (
    Ack,
    AgentEvent,
    Message,
    Participant,
    ReplyAck,
    Runtime,
    Welcome,
    parse_agent_event,
)
from .streams import STREAM_FRAME_TYPES, AnswerStream

__all__ = ["Agent", "EventHandler", "FrameLike", "Turn", "TurnHandler", "result_client_id"]

log = logging.getLogger("converger.agent")

# Delivered turns a ``cancel`` can still reach: the most recent ones.
_CANCELLABLE_TURNS = 4096

TurnHandler = Callable[["Turn"], Awaitable[None]]
"""An async function answering one turn."""

EventHandler = Callable[[AgentEvent], Awaitable[None]]
"""An async function receiving the agent's other events (forwarded frames, typing, …)."""

RESENT_CODES = frozenset({"internal", "rate_limited", "too_many_in_flight", "unavailable"})
"""Refusals after which the same frame is sent again (after ``retryAfterMs``)."""
DEFAULT_RETRY_AFTER = 1.0
RESEND_TICK = 0.05
UNKNOWN_FRAME_LIMIT = 16384


def result_client_id(conversation_id: str, seq: int, revision: int, fence: int | None) -> str:
    """The clientId of a turn's answer, the same for every resend of it.

    ``result-<conversation as 32 hex digits>-<seq>-<revision>`` (the Rust client's scheme), plus
    ``-f<fence>`` in lease mode, so the answers of two claims of one turn are told apart.
    """
    try:
        compact = UUID(conversation_id).hex
    except ValueError:
        compact = "".join(ch for ch in conversation_id if ch.isalnum())[:64]
    client_id = f"result-{compact}-{seq}-{revision}"
    if fence is not None:
        client_id = f"{client_id}-f{fence}"
    return client_id


@dataclass(eq=False)
class Turn:
    """One user turn delivered to this agent (a revision of it).

    ``seq``/``revision``/``key`` come from ``meta.turn`` (answer with these, never with
    ``frame["seq"]``, which for an edit is the edit's own seq); ``reason`` is ``"edit"`` or
    ``"regenerate"`` above revision 0; ``fence`` is the lease-mode fencing token; ``runtime`` is
    the conversation's runtime to build on (the delivered one, or the newer one this agent wrote
    since); ``frame`` is the delivered frame and ``meta`` its ``meta``.
    """

    conversation_id: str
    seq: int
    revision: int
    key: str
    reason: str | None
    runtime: Runtime
    delivered_runtime: Runtime
    frame: JSONObject
    meta: JSONObject
    fence: int | None
    participant: Participant | None
    channel_id: str | None
    message: Message | None
    _agent: Agent = field(repr=False)
    ack: ReplyAck | None = field(default=None, repr=False)
    """The ack of this turn's answer, once :meth:`reply` succeeded."""
    cancel_reason: str | None = field(default=None)
    """Why the turn was cancelled (``"stopped"``, ``"superseded"``, ``"user_disconnected"``,
    ``"conversation_closed"``), once it was."""
    _cancelled: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _handler_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def cancelled(self) -> bool:
        """True once the end user stopped this turn (a ``cancel``, ``docs/protocol.md`` §4.10).

        Under :meth:`Agent.run` the handler's task is cancelled at once (``asyncio``
        cancellation); in the iterator style, check this or await :meth:`wait_cancelled`. An
        answer sent within the grace period is still the turn's result; after it the gateway
        settles the turn with what was streamed and a reply raises :class:`TurnStopped`.
        """
        return self._cancelled.is_set()

    async def wait_cancelled(self) -> str:
        """Waits until the turn is cancelled; returns the reason."""
        await self._cancelled.wait()
        return self.cancel_reason or "stopped"

    def _cancel(self, reason: str) -> None:
        if self._cancelled.is_set():
            return
        self.cancel_reason = reason
        self._cancelled.set()
        if self._handler_task is not None and not self._handler_task.done():
            self._handler_task.cancel()

    @property
    def type(self) -> str | None:
        """The delivered frame's type (``text``, ``event``, …)."""
        return as_str(self.frame.get("type"))

    @property
    def data(self) -> JSONObject:
        """The delivered frame's ``data``."""
        return as_object(self.frame.get("data"))

    @property
    def text(self) -> str | None:
        """The user's text, for ``text`` turns."""
        return as_str(self.data.get("text"))

    @property
    def client_id(self) -> str:
        """The clientId every send of this turn's answer uses."""
        return result_client_id(self.conversation_id, self.seq, self.revision, self.fence)

    async def reply(
        self,
        frames: FrameLike | Iterable[FrameLike] = (),
        runtime: Runtime | Mapping[str, Any] | None = None,
        *,
        timeout: float | None = 120.0,
    ) -> ReplyAck:
        """Answers the turn: an enveloped ``turnResult``, resent with the same clientId until acked.

        ``frames`` are whole message frames (``{"type": "text", "data": {"text": …}}``, a
        ``tool_call``, an ``interrupt`` with its own ``id``, …; a string is a ``text`` frame);
        none completes the turn without storing anything. ``runtime`` is the new runtime
        state, written against ``self.runtime.version`` (pass a :class:`Runtime` to name the
        version yourself). The result is resent every ``resend_interval`` and after every
        reconnect until the server answers, so a lost ack never produces a second answer
        (the resend is acked with ``duplicate=True``); ``internal`` refusals are resent after
        their ``retryAfterMs``.

        Raises :class:`TurnConflict`, :class:`TurnSuperseded`, :class:`StaleRuntime`,
        :class:`LeaseLost` or :class:`ServerError` for refusals, :class:`AckTimeout` when no
        answer came within ``timeout`` seconds (``None``: wait as long as the agent lives),
        :class:`FatalClose`/:class:`GaveUp`/:class:`ClientClosed` when the agent stopped.
        """
        ack = await self._agent._reply(self, frames_of(frames), runtime, timeout)
        self.ack = ack
        return ack

    async def typing(self, is_typing: bool = True) -> bool:
        """Shows (or hides) the agent typing to the conversation's end users (transient).

        False when it could not be written (disconnected); it is not sent later.
        """
        return await self._agent.typing(self.conversation_id, is_typing)

    async def run_status(self, data: Mapping[str, Any]) -> bool:
        """Sends a ``run`` status frame with ``data``, relayed as is (transient)."""
        return await self._agent.run_status(self.conversation_id, data)

    async def send(self, frame: FrameLike, *, client_id: str | None = None) -> Ack:
        """Stores a proactive frame in this turn's conversation (see :meth:`Agent.send`)."""
        return await self._agent.send(self.conversation_id, frame, client_id=client_id)

    def stream(self, stream_id: str | None = None) -> AnswerStream:
        """A streamed answer for this turn (``docs/protocol.md`` §4.9); see :class:`AnswerStream`.

        ``stream_id`` must have the clientId shape and be unique in the conversation (a stream
        that ended cannot be opened again); by default it is
        ``stream-<seq>-<revision>-<16 random hex digits>``, unique also across reconnects,
        takeovers and other workers. Nothing is sent until the first chunk. Use it as
        ``async with turn.stream() as stream:``, or call ``finish()``/``abort()`` yourself.
        """
        return self._agent._open_stream(self, stream_id)


@dataclass(eq=False)
class _Outgoing:
    """A keyed frame waiting for its ack."""

    client_id: str
    text: str
    future: asyncio.Future[JSONObject]
    conversation_id: str
    runtime_written: Runtime | None
    last_sent: float | None = None
    retry_at: float | None = None


@dataclass(eq=False)
class _ConversationSlot:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class Agent:
    """An agent connection to one node, serving the conversations of its token's channel.

    ``url`` is the node's WebSocket endpoint (``ws://host:port/socket/converger/v1``; an
    ``http://host:port`` base works too), ``token`` a channel-scope token. ``group`` joins that
    group (``None`` observes: no turns, every frame as an event); ``lease=True`` asks for lease
    mode (``hello.claim = "lease"``, needs a group): each turn comes with a fence that the
    answer carries back, and a stale one is refused with :class:`LeaseLost`. ``watermarks``
    seeds the per-conversation seqs already seen (sent in ``hello.watermarks``).

    ``backoff`` paces reconnects; ``resend_interval`` is the wait before an unacked frame is
    sent again on the same connection; ``open_timeout`` bounds each upgrade and handshake;
    ``hello_watermarks`` caps the conversations named in ``hello.watermarks`` (the most recently
    active first; fewer when the hello would pass ``maxFrameBytes``).

    Use it as ``async with Agent(...) as agent``, or call :meth:`connect` and :meth:`close`.
    Turns come from :meth:`turns` (or ``async for turn in agent``), or go to the handler of
    :meth:`run`; other frames come from :meth:`events` or the ``@agent.event`` handler.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        group: str | None = None,
        lease: bool = False,
        watermarks: Mapping[str, int] | None = None,
        backoff: Backoff | None = None,
        resend_interval: float = 5.0,
        open_timeout: float = 10.0,
        hello_watermarks: int = 500,
    ) -> None:
        if lease and group is None:
            raise ValueError("lease mode needs a group")
        self._url = ws_url(url)
        self._token = token
        self._group = group
        self._lease = lease
        self._backoff = backoff or Backoff()
        self._resend_interval = resend_interval
        self._open_timeout = open_timeout
        self._hello_watermarks = hello_watermarks
        self._tracker = ChannelTracker(watermarks)
        self._runtimes: OrderedDict[str, Runtime] = OrderedDict()
        self._outbox: dict[str, _Outgoing] = {}
        self._outbox_empty = asyncio.Event()
        self._outbox_empty.set()
        self._turn_queue: asyncio.Queue[Turn | None] = asyncio.Queue()
        self._event_queue: asyncio.Queue[AgentEvent | None] | None = None
        self._ws: ClientConnection | None = None
        self._welcome: Welcome | None = None
        self._changed = asyncio.Event()  # replaced after each change of connection state
        self._supervisor: asyncio.Task[None] | None = None
        self._resender: asyncio.Task[None] | None = None
        self._fatal: ConvergerError | None = None
        self._last_error: ServerError | None = None
        self._last_hint: float | None = None
        self._last_disconnect: Disconnect | None = None
        self._connected_at: float | None = None
        self._stopping = False
        self._closed = False
        self._close_started: asyncio.Future[None] | None = None
        self._turn_handler: TurnHandler | None = None
        self._event_handler: EventHandler | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._live_turns: OrderedDict[str, Turn] = OrderedDict()
        self._connections = 0
        self._streams: weakref.WeakValueDictionary[tuple[str, str], AnswerStream] = (
            weakref.WeakValueDictionary()
        )

    # --- state -------------------------------------------------------------------------

    @property
    def welcome(self) -> Welcome:
        """The latest ``welcome`` (replaced on every reconnect: new connectionId and since)."""
        if self._welcome is None:
            raise RuntimeError("the agent is not connected yet")
        return self._welcome

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
    def group(self) -> str | None:
        """The group this agent joins (``None``: an observer)."""
        return self._group

    @property
    def watermarks(self) -> dict[str, int]:
        """Per conversation, the highest seq seen: what the next ``hello.watermarks`` names."""
        return self._tracker.watermarks()

    @property
    def unacked(self) -> list[str]:
        """ClientIds of the replies and proactive frames still waiting for their ack."""
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
                    raise ClientClosed("the agent is closed")
                await self._changed.wait()
        return self.welcome

    async def wait_eligible(self) -> None:
        """Waits until this member's ``welcome.since`` has passed on this machine's clock.

        A member owns nothing committed before its ``since`` (unless it is alone in its group);
        on the node's machine, this is when turns start to reach it.
        """
        since = self.welcome.since
        if since is None:
            return
        delay = since / 1000 - time.time() + 0.02
        if delay > 0:
            await asyncio.sleep(delay)

    # --- lifecycle ---------------------------------------------------------------------

    async def connect(self) -> Welcome:
        """Opens the first connection (one attempt) and starts serving.

        Raises :class:`FatalClose` when the node refuses the hello for good (bad token,
        inactive channel, bad group) and :class:`GaveUp` when it cannot be reached. Later
        disconnections are reconnected in the background.
        """
        if self._closed:
            raise ClientClosed("the agent is closed")
        if self._supervisor is not None:
            return self.welcome
        try:
            opened = await open_session(self._url, self._hello(), self._open_timeout)
        except Retry as failure:
            raise GaveUp(1, failure) from None
        await self._attach(opened)
        self._supervisor = asyncio.create_task(self._supervise(), name="converger-agent")
        self._resender = asyncio.create_task(self._resend_loop(), name="converger-agent-resend")
        return self.welcome

    async def __aenter__(self) -> Agent:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def stop(self) -> None:
        """Stops handing out turns; :meth:`run` then drains and returns.

        Turns delivered but not started are dropped: once this agent leaves its group, the
        server hands its unanswered turns to the other members.
        """
        if self._stopping:
            return
        self._stopping = True
        while not self._turn_queue.empty():
            self._turn_queue.get_nowait()
        self._turn_queue.put_nowait(None)
        if self._event_queue is not None:
            self._event_queue.put_nowait(None)

    async def close(self, timeout: float = 10.0) -> None:
        """Stops, lets running handlers and unacked replies finish, then closes (1000).

        Waits at most ``timeout`` seconds in all for the handlers :meth:`run` started and for
        the acks of the frames still waiting; whatever is left then is cancelled and fails with
        :class:`ClientClosed`.
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
        self.stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        current = asyncio.current_task()
        handlers = [task for task in self._handlers if task is not current]
        if handlers:
            await asyncio.wait(handlers, timeout=max(deadline - loop.time(), 0.0))
        if self._outbox and self._fatal is None and self._supervisor is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                    await self._outbox_empty.wait()
        self._closed = True
        for task in handlers:
            task.cancel()
        ws = self._ws
        self._detach()
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close(1000)
        for background in (self._resender, self._supervisor):
            if background is not None and background is not current and not background.done():
                background.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await background
        self._fail_outbox(ClientClosed("the agent was closed before the server answered"))
        self._notify()

    # --- handler style -----------------------------------------------------------------

    def turn(self, handler: TurnHandler) -> TurnHandler:
        """Decorator: ``handler`` answers the turns when :meth:`run` is called without one."""
        self._turn_handler = handler
        return handler

    def event(self, handler: EventHandler) -> EventHandler:
        """Decorator: ``handler`` receives the other events while :meth:`run` runs.

        Events are handled one at a time, in arrival order, beside the turns.
        """
        self._event_handler = handler
        return handler

    async def run(
        self,
        handler: TurnHandler | None = None,
        *,
        concurrency: int = 1,
        drain_timeout: float = 10.0,
    ) -> None:
        """Serves turns with ``handler`` (or the ``@agent.turn`` one) until :meth:`stop`.

        Up to ``concurrency`` turns are handled at once; the turns of one conversation are
        handled one at a time, in delivery order, each seeing the runtime the previous answer
        wrote. A handler that raises is logged; its turn may come again (a replay, a sync).
        Connects first when needed. On :meth:`stop` (or a fatal close) the running handlers
        and unacked replies get ``drain_timeout`` seconds, then the agent closes; a fatal
        close (:class:`FatalClose`, :class:`GaveUp`) is raised after that.
        """
        handler = handler or self._turn_handler
        if handler is None:
            raise ValueError("no turn handler: pass one or decorate one with @agent.turn")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self._supervisor is None:
            await self.connect()
        semaphore = asyncio.Semaphore(concurrency)
        slots: dict[str, _ConversationSlot] = {}
        event_task: asyncio.Task[None] | None = None
        if self._event_handler is not None:
            event_task = asyncio.create_task(self._dispatch_events(self._event_handler))
        try:
            async for turn in self.turns():
                task = asyncio.create_task(self._handle(turn, handler, semaphore, slots))
                self._handlers.add(task)
                task.add_done_callback(self._handlers.discard)
        finally:
            await self.close(timeout=drain_timeout)
            if event_task is not None:
                event_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await event_task

    async def _handle(
        self,
        turn: Turn,
        handler: TurnHandler,
        semaphore: asyncio.Semaphore,
        slots: dict[str, _ConversationSlot],
    ) -> None:
        slot = slots.setdefault(turn.conversation_id, _ConversationSlot())
        slot.users += 1
        try:
            async with slot.lock, semaphore:
                if self._stopping:
                    return
                self._freshen(turn)
                if turn.cancelled:
                    return
                # Its own task, so that a cancel stops the handler and nothing else.
                handler_task: asyncio.Task[None] = asyncio.ensure_future(handler(turn))
                turn._handler_task = handler_task
                try:
                    await handler_task
                except asyncio.CancelledError:
                    if not (turn.cancelled and handler_task.cancelled()):
                        raise
                    log.info("turn %s: cancelled (%s)", turn.key, turn.cancel_reason)
                except (
                    TurnConflict,
                    TurnSuperseded,
                    TurnStopped,
                    LeaseLost,
                    StreamClosed,
                ) as refused:
                    log.info("turn %s: answer dropped: %s", turn.key, refused)
                except StreamInterrupted as interrupted:
                    log.warning("turn %s: %s", turn.key, interrupted)
                    self._tracker.forget_delivery(turn.conversation_id, turn.seq, turn.revision)
                except StaleRuntime as stale:
                    log.warning("turn %s: %s", turn.key, stale)
                    self._tracker.forget_delivery(turn.conversation_id, turn.seq, turn.revision)
                except (ClientClosed, FatalClose, GaveUp):
                    pass
                except Exception:
                    log.exception("turn %s: the handler failed", turn.key)
                    self._tracker.forget_delivery(turn.conversation_id, turn.seq, turn.revision)
        finally:
            slot.users -= 1
            if slot.users == 0:
                slots.pop(turn.conversation_id, None)

    async def _dispatch_events(self, handler: EventHandler) -> None:
        async for event in self.events():
            try:
                await handler(event)
            except Exception:
                log.exception("the event handler failed on %s", type(event).__name__)

    # --- iterator style ----------------------------------------------------------------

    async def turns(self) -> AsyncIterator[Turn]:
        """The turns delivered to this agent, each delivery once, until :meth:`stop`.

        A turn comes again only as a new revision (an edit, a regeneration) or, in lease mode,
        under a newer claim (a higher fence). Raises :class:`FatalClose` or :class:`GaveUp` at
        the end when the agent stopped for good.
        """
        while True:
            item = await self._turn_queue.get()
            if item is None:
                self._turn_queue.put_nowait(None)
                if self._fatal is not None:
                    raise self._fatal
                return
            self._freshen(item)
            yield item

    def __aiter__(self) -> AsyncIterator[Turn]:
        return self.turns()

    async def events(self) -> AsyncIterator[AgentEvent]:
        """Everything else delivered to this agent, typed, until :meth:`stop`.

        Forwarded client frames (:class:`~converger.Resume`, :class:`~converger.Abort`,
        :class:`~converger.GenuiEvent`, :class:`~converger.ClientTools`,
        :class:`~converger.ClientSkills`, :class:`~converger.Survey`), end users' typing, read
        receipts and presence, and other parties' persistent frames. Events are kept from the
        first call on (or from :meth:`run` with an event handler); earlier ones are dropped.
        """
        queue = self._events()
        while True:
            item = await queue.get()
            if item is None:
                queue.put_nowait(None)
                return
            yield item

    def _events(self) -> asyncio.Queue[AgentEvent | None]:
        if self._event_queue is None:
            self._event_queue = asyncio.Queue()
            if self._stopping:
                self._event_queue.put_nowait(None)
        return self._event_queue

    # --- sending -----------------------------------------------------------------------

    async def send(
        self,
        conversation_id: str,
        frame: FrameLike,
        *,
        client_id: str | None = None,
        timeout: float | None = 120.0,
    ) -> Ack:
        """Stores a proactive frame (not an answer to a turn) and returns its :class:`Ack`.

        The frame is idempotent by its clientId (``client_id``, else the frame's own, else a
        fresh one) per conversation and sender: it is resent until acked, and a resend is
        acked with ``duplicate=True`` without storing anything again. Refusals raise
        :class:`ServerError`.
        """
        body = frame_of(frame)
        key = client_id or as_str(body.get("clientId")) or f"p-{uuid4().hex}"
        body["clientId"] = key
        envelope = {"conversationId": conversation_id, "frame": body}
        acked = await self._submit(key, envelope, conversation_id, None, timeout)
        return Ack.parse(acked)

    async def typing(self, conversation_id: str, is_typing: bool = True) -> bool:
        """Relays ``typing`` to the conversation's end users (transient; false if not written)."""
        frame = {"type": "typing", "isTyping": is_typing}
        return await self._write(dumps({"conversationId": conversation_id, "frame": frame}))

    async def run_status(self, conversation_id: str, data: Mapping[str, Any]) -> bool:
        """Relays a ``run`` frame, ``data`` verbatim (transient; false if not written)."""
        frame = {"type": "run", "data": dict(data)}
        return await self._write(dumps({"conversationId": conversation_id, "frame": frame}))

    async def relay_error(
        self, conversation_id: str, code: str, message: str | None = None, **fields: Any
    ) -> bool:
        """Relays an ``error`` frame (``busy``, ``interrupted``, …) to the end users (transient)."""
        data: JSONObject = {"code": code, **fields}
        if message is not None:
            data["message"] = message
        frame = {"type": "error", "data": data}
        return await self._write(dumps({"conversationId": conversation_id, "frame": frame}))

    async def sync(self, conversation_id: str, watermark: int) -> bool:
        """Asks for the frames after ``watermark`` that this member owns (transient).

        Turns come back as turns, except the deliveries already handed out.
        """
        frame = {"type": "sync", "watermark": max(watermark, 0)}
        return await self._write(dumps({"conversationId": conversation_id, "frame": frame}))

    async def refresh_token(self, token: str) -> bool:
        """Uses ``token`` from now on: sent as ``auth`` on the open socket and in later hellos."""
        self._token = token
        return await self._write(dumps({"type": "auth", "token": token}))

    def _open_stream(self, turn: Turn, stream_id: str | None) -> AnswerStream:
        if stream_id is None:
            stream_id = f"stream-{turn.seq}-{turn.revision}-{uuid4().hex[:16]}"
        elif not is_valid_client_id(stream_id):
            raise ValueError(f"invalid streamId {stream_id!r} (1-128 of A-Za-z0-9._:~-)")
        key = (turn.conversation_id, stream_id)
        if key in self._streams:
            raise ValueError(f"stream {stream_id} is already open in this conversation")
        self._require_alive()
        stream = AnswerStream(self, turn, stream_id)
        self._streams[key] = stream
        return stream

    def _forget_stream(self, stream: AnswerStream) -> None:
        key = (stream.conversation_id, stream.stream_id)
        if self._streams.get(key) is stream:
            del self._streams[key]

    def _require_alive(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise ClientClosed("the agent is closed")

    async def _write_enveloped(self, conversation_id: str, frame: JSONObject) -> bool:
        return await self._write(dumps({"conversationId": conversation_id, "frame": frame}))

    async def _reply(
        self,
        turn: Turn,
        frames: list[JSONObject],
        runtime: Runtime | Mapping[str, Any] | None,
        timeout: float | None,
    ) -> ReplyAck:
        reference: JSONObject = {"seq": turn.seq, "revision": turn.revision}
        if turn.fence is not None:
            reference["fence"] = turn.fence
        client_id = turn.client_id
        result: JSONObject = {
            "type": "turnResult",
            "clientId": client_id,
            "turn": reference,
            "frames": frames,
        }
        written: Runtime | None = None
        if runtime is not None:
            written = (
                runtime
                if isinstance(runtime, Runtime)
                else Runtime(turn.runtime.version, dict(runtime))
            )
            result["runtime"] = written.to_json()
        envelope = {"conversationId": turn.conversation_id, "frame": result}
        acked = await self._submit(client_id, envelope, turn.conversation_id, written, timeout)
        return ReplyAck.parse(acked)

    async def _submit(
        self,
        client_id: str,
        envelope: JSONObject,
        conversation_id: str,
        runtime_written: Runtime | None,
        timeout: float | None,
    ) -> JSONObject:
        if self._fatal is not None:
            raise self._fatal
        if self._closed:
            raise ClientClosed("the agent is closed")
        text = dumps(envelope)
        limit = self._welcome.limits.max_frame_bytes if self._welcome else None
        size = len(text.encode())
        if limit is not None and size > limit:
            raise FrameTooLarge(size, limit)
        entry = self._outbox.get(client_id)
        if entry is not None and entry.text != text:
            raise ValueError(
                f"another frame with clientId {client_id} is still waiting for its ack"
            )
        if entry is None:
            future: asyncio.Future[JSONObject] = asyncio.get_running_loop().create_future()
            future.add_done_callback(_consume)
            entry = _Outgoing(client_id, text, future, conversation_id, runtime_written)
            self._outbox[client_id] = entry
            self._outbox_empty.clear()
            await self._transmit(entry)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(entry.future)
        except TimeoutError:
            if not entry.future.done():
                self._settle(client_id)
                raise AckTimeout(client_id, timeout or 0.0) from None
            raise

    async def _transmit(self, entry: _Outgoing) -> None:
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

    def _settle(self, client_id: str) -> _Outgoing | None:
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
                if entry.retry_at is not None:
                    due = now >= entry.retry_at
                else:
                    due = entry.last_sent is None or now - entry.last_sent >= self._resend_interval
                if due and self._outbox.get(entry.client_id) is entry:
                    await self._transmit(entry)

    # --- connection --------------------------------------------------------------------

    def _hello(self) -> JSONObject:
        hello: JSONObject = {"type": "hello", "protocol": "converger/1", "token": self._token}
        if self._group is not None:
            hello["group"] = self._group
        if self._lease:
            hello["claim"] = "lease"
        limit = (self._welcome.limits.max_frame_bytes if self._welcome else 16384) * 3 // 4
        budget = limit - len(dumps(hello)) - 32
        watermarks: dict[str, int] = {}
        for conversation_id, seq in self._tracker.watermarks(self._hello_watermarks).items():
            budget -= len(conversation_id) + len(str(seq)) + 6
            if budget < 0:
                break
            watermarks[conversation_id] = seq
        if watermarks:
            hello["watermarks"] = watermarks
        return hello

    async def _attach(self, opened: Opened) -> None:
        self._ws = opened.ws
        self._welcome = Welcome.parse(opened.welcome)
        self._last_error = None
        self._last_hint = None
        self._connections += 1
        self._connected_at = asyncio.get_running_loop().time()
        welcome = self._welcome
        log.info(
            "agent connected: %s %s as %s since %s%s",
            "member of" if welcome.group else "observer",
            welcome.group or "",
            welcome.connection_id,
            welcome.since,
            " (lease mode)" if welcome.claim == "lease" else "",
        )
        for message in opened.early:
            self._on_message(message)
        self._notify()
        for entry in list(self._outbox.values()):
            await self._transmit(entry)

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
            log.error("agent stopped: %s", error)
            self._fail(error)
        except Exception as error:  # a bug: stop loudly rather than hang
            log.exception("agent connection loop failed")
            self._fail(ConvergerError(f"the connection loop failed: {error!r}"))

    async def _read(self, ws: ClientConnection) -> float | None:
        try:
            async for text in ws:
                message = loads_object(text)
                if message is None:
                    log.warning("ignored a message that is not a JSON object")
                    continue
                try:
                    self._on_message(message)
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
            log.warning("agent connection lost; reconnecting")
        else:
            log.warning("agent disconnected (%s %s); reconnecting", code, reason)
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
                log.warning("agent reconnect attempt %d failed: %s", attempt, failure)
                if self._backoff.exhausted(attempt):
                    raise GaveUp(attempt, failure) from None
                continue
            if self._closed:
                await opened.ws.close()
                return
            await self._attach(opened)
            return

    def _fail(self, error: ConvergerError) -> None:
        self._fatal = error
        self._detach()
        self._fail_outbox(error)
        self._notify()
        if not self._stopping:
            self._stopping = True
            self._turn_queue.put_nowait(None)
            if self._event_queue is not None:
                self._event_queue.put_nowait(None)

    # --- receiving ---------------------------------------------------------------------

    def _on_message(self, message: JSONObject) -> None:
        conversation_id = as_str(message.get("conversationId"))
        frame = message.get("frame")
        if conversation_id is None or not isinstance(frame, dict):
            self._on_bare(message)
            return
        kind = as_str(frame.get("type"))
        if kind == "ack":
            self._on_ack(conversation_id, frame)
            return
        if kind == "cancel":
            key = as_str(as_object(frame.get("turn")).get("key"))
            turn = self._live_turns.get(key or "")
            if turn is not None:
                turn._cancel(as_str(frame.get("reason")) or "stopped")
            return
        if kind == "error":
            self._on_error(as_object(frame.get("data")), conversation_id)
            return
        seq = as_int(frame.get("seq"))
        if seq is not None:
            self._tracker.observe_seq(conversation_id, seq)
        meta = as_object(frame.get("meta"))
        turn_meta = meta.get("turn")
        if isinstance(turn_meta, dict):
            turn = self._parse_turn(conversation_id, frame, meta, turn_meta)
            if turn is not None:
                if self._stopping:
                    return
                if self._tracker.first_delivery(
                    conversation_id, turn.seq, turn.revision, turn.fence
                ):
                    self._live_turns[turn.key] = turn
                    while len(self._live_turns) > _CANCELLABLE_TURNS:
                        self._live_turns.popitem(last=False)
                    self._turn_queue.put_nowait(turn)
                return
        if self._event_queue is not None and not self._stopping:
            self._event_queue.put_nowait(parse_agent_event(conversation_id, frame))

    def _parse_turn(
        self, conversation_id: str, frame: JSONObject, meta: JSONObject, turn_meta: JSONObject
    ) -> Turn | None:
        seq = as_int(turn_meta.get("seq"))
        if seq is None:
            return None
        revision = as_int(turn_meta.get("revision")) or 0
        runtime = Runtime.parse(meta.get("runtime"))
        return Turn(
            conversation_id=conversation_id,
            seq=seq,
            revision=revision,
            key=as_str(turn_meta.get("key")) or f"{conversation_id}:{seq}:{revision}",
            reason=as_str(turn_meta.get("reason")),
            runtime=runtime,
            delivered_runtime=runtime,
            frame=frame,
            meta=meta,
            fence=as_int(turn_meta.get("fence")),
            participant=Participant.parse(meta.get("participant")),
            channel_id=as_str(as_object(meta.get("channel")).get("id")),
            message=Message.parse(frame),
            _agent=self,
        )

    def _freshen(self, turn: Turn) -> None:
        known = self._runtimes.get(turn.conversation_id)
        if known is not None and known.version > turn.runtime.version:
            turn.runtime = known

    def _remember_runtime(self, conversation_id: str, runtime: Runtime) -> None:
        known = self._runtimes.get(conversation_id)
        if known is None or runtime.version >= known.version:
            self._runtimes[conversation_id] = runtime
        self._runtimes.move_to_end(conversation_id)
        while len(self._runtimes) > REMEMBERED_CONVERSATIONS:
            self._runtimes.popitem(last=False)

    def _on_ack(self, conversation_id: str, frame: JSONObject) -> None:
        client_id = as_str(frame.get("clientId"))
        if client_id is None:
            return
        entry = self._settle(client_id)
        if entry is None:
            return  # a late duplicate ack of something already settled
        if entry.runtime_written is not None:
            written = entry.runtime_written
            self._remember_runtime(conversation_id, Runtime(written.version + 1, written.state))
        if not entry.future.done():
            entry.future.set_result(frame)

    def _on_error(self, data: JSONObject, conversation_id: str | None) -> None:
        error = ServerError.from_data(data)
        entry = self._outbox.get(error.client_id) if error.client_id else None
        now = asyncio.get_running_loop().time()
        if entry is not None:
            if error.code in RESENT_CODES:
                delay = retry_hint_of_error(data) or DEFAULT_RETRY_AFTER
                entry.retry_at = now + delay
                log.info("%s refused with %s; resending in %.2f s", entry.client_id, error, delay)
                return
            self._settle(entry.client_id)
            if isinstance(error, StaleRuntime):
                self._runtimes.pop(entry.conversation_id, None)
            if not entry.future.done():
                entry.future.set_exception(error)
            return
        if conversation_id is not None and error.frame_type in STREAM_FRAME_TYPES:
            stream = self._streams.get((conversation_id, error.stream_id or ""))
            if stream is not None and error.frame_type == "streamChunk":
                stream._refused(error)
            else:
                log.debug("stream error in conversation %s: %s", conversation_id, error)
            return
        if conversation_id is None:
            self._last_error = error
            hint = retry_hint_of_error(data)
            if hint is not None:
                self._last_hint = hint
            if error.code == "rate_limited":
                for waiting in self._outbox.values():
                    waiting.retry_at = now + (hint or DEFAULT_RETRY_AFTER)
            log.warning("agent connection error: %s", error)
        else:
            log.warning("agent error in conversation %s: %s", conversation_id, error)

    def _on_bare(self, message: JSONObject) -> None:
        kind = as_str(message.get("type"))
        if kind == "error":
            self._on_error(as_object(message.get("data")), None)
        elif kind == "tokenRefreshed":
            log.info("agent token refreshed")
        elif kind not in ("heartbeat", "welcome"):
            log.debug("ignored bare frame %s", str(message)[:UNKNOWN_FRAME_LIMIT])


def _consume(future: asyncio.Future[JSONObject]) -> None:
    """Marks a settled future's exception as retrieved (its waiter may be gone)."""
    if not future.cancelled():
        future.exception()
