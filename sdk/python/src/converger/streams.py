"""Streamed answers (``docs/protocol.md`` §4.9): the agent's writer and the end user's assembly.

An agent shows its answer while it writes it: :meth:`Turn.stream() <converger.Turn.stream>`
opens an :class:`AnswerStream`, whose chunks reach every end-user connection of the
conversation at once (never stored, never acknowledged), and which ends with the turn's
committed answer (:meth:`AnswerStream.finish`) or an abort::

    async with turn.stream() as stream:
        async for word in model.generate(turn.text):
            await stream.text(word)
        await stream.finish()  # commits the streamed text as the turn's answer

End users get ``streamChunk`` and ``streamEnd`` frames; a new connection is shown every open
stream from its first chunk again, so :class:`StreamAssembly` keeps what arrived by stream and
index and applies each chunk once (:attr:`Conversation.streams <converger.Conversation.streams>`
is one, kept across reconnects).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from ._json import JSONObject, dumps
from ._shapes import FrameLike, frames_of
from .errors import FrameTooLarge, ServerError, StaleRuntime, StreamInterrupted
from .frames import Message, Participant, ReplyAck, Runtime, StreamChunk, StreamEnd, TurnRef

if TYPE_CHECKING:
    from .agent import Agent, Turn

__all__ = ["AnswerStream", "AssembledStream", "StreamAssembly", "StreamUpdate"]

log = logging.getLogger("converger.streams")

STREAM_FRAME_TYPES = frozenset({"streamChunk", "streamAbort"})
"""The ``frameType`` of the refusals that concern a stream (routed to the stream)."""


# --- The agent's side ------------------------------------------------------------------------


class AnswerStream:
    """A streamed answer an agent writes for one delivered turn; make one with ``turn.stream()``.

    :meth:`text` sends a text delta and :meth:`chunk` a genui chunk object, each as the next
    ``streamChunk`` (the first one names the turn, with its fence in lease mode). Chunks are
    not acknowledged: the answer becomes durable with :meth:`finish`, which commits the turn's
    result through the same resend-until-acked path as :meth:`Turn.reply
    <converger.Turn.reply>` and ends the stream for every viewer; :meth:`abort` ends it without
    an answer.

    As an async context manager: an exception that escapes the block aborts the stream (reason
    ``"error"``) and is re-raised; a block that ends normally without :meth:`finish` or
    :meth:`abort` calls ``finish()``, committing the streamed text as one ``text`` frame.

    Errors:

    - a chunk sent while the connection is down, or after it dropped since the stream opened,
      raises :class:`~converger.StreamInterrupted` (the server aborted the stream when the
      connection ended). The turn can still be answered: ``finish()`` and ``turn.reply()``
      resend until acknowledged over the next connection.
    - a chunk the server refused is answered by an ``error`` frame, after the call that sent it
      has returned. The refusal is kept in :attr:`refusal` and raised, as its typed
      :class:`~converger.ServerError` (:class:`~converger.LeaseLost`,
      :class:`~converger.TurnSuperseded`, :class:`~converger.StreamClosed`,
      :class:`~converger.TooManyStreams`, or a plain ``ServerError`` for ``invalid_message``,
      ``payload_too_large``, ``bad_request``, ``internal``), by every later :meth:`text` and
      :meth:`chunk`. :meth:`finish` does not raise it: the turn registry decides whether the
      answer commits, and raises its own typed refusal (a lost lease is ``LeaseLost`` there
      too).

    Once an operation has raised, leaving the ``async with`` block normally does not commit
    the partial text: the stream is aborted and answering the turn is left to the caller
    (``finish()`` called explicitly still commits).

    Chunks count against the node's ``max_frames_per_sec`` (50 per connection by default, with
    a burst of as many): stream words or sentences, not characters. A chunk dropped as
    ``rate_limited`` makes the next one refused (``invalid_message``, an index gap).
    """

    def __init__(self, agent: Agent, turn: Turn, stream_id: str) -> None:
        self._agent = agent
        self._turn = turn
        self._stream_id = stream_id
        self._index = 0
        self._parts: list[str] = []
        self._opened_on: int | None = None  # the agent's connection count when index 0 went out
        self._state: Literal["open", "finished", "aborted"] = "open"
        self._refusal: ServerError | None = None
        self._raised: BaseException | None = None
        self._ack: ReplyAck | None = None
        self._lock = asyncio.Lock()

    # --- state ---------------------------------------------------------------------------

    @property
    def stream_id(self) -> str:
        """The stream's id: the ``streamId`` of its chunks and of the committed answer."""
        return self._stream_id

    @property
    def turn(self) -> Turn:
        """The turn this stream answers."""
        return self._turn

    @property
    def conversation_id(self) -> str:
        """The turn's conversation."""
        return self._turn.conversation_id

    @property
    def streamed_text(self) -> str:
        """The text deltas sent so far, joined (what ``finish()`` commits by default)."""
        return "".join(self._parts)

    @property
    def chunks_sent(self) -> int:
        """How many chunks were written (the next chunk's index)."""
        return self._index

    @property
    def state(self) -> Literal["open", "finished", "aborted"]:
        """``open``, ``finished`` (:meth:`finish` was called) or ``aborted``."""
        return self._state

    @property
    def refusal(self) -> ServerError | None:
        """The server's refusal of one of this stream's chunks, once one arrived."""
        return self._refusal

    @property
    def ack(self) -> ReplyAck | None:
        """The ack of the committed answer, once :meth:`finish` succeeded."""
        return self._ack

    # --- sending -------------------------------------------------------------------------

    async def text(self, delta: str) -> None:
        """Sends ``delta`` as the next text chunk (an empty delta sends nothing).

        Raises :class:`~converger.StreamInterrupted` when the connection is down or dropped
        since the stream opened, the stream's :attr:`refusal` once one arrived,
        :class:`~converger.FrameTooLarge` for a chunk above ``maxFrameBytes`` (not sent; the
        stream goes on), and :class:`RuntimeError` after :meth:`finish` or :meth:`abort`.
        """
        if not isinstance(delta, str):
            raise TypeError(f"a text delta is a str, not {type(delta).__name__}")
        if delta:
            await self._send("text", delta)

    async def chunk(self, chunk: Mapping[str, Any]) -> None:
        """Sends a genui chunk object (shown to end users as it is) as the next chunk.

        Raises as :meth:`text` does.
        """
        await self._send("chunk", dict(chunk))

    async def finish(
        self,
        frames: FrameLike | Iterable[FrameLike] | None = None,
        runtime: Runtime | Mapping[str, Any] | None = None,
        *,
        timeout: float | None = 120.0,
    ) -> ReplyAck:
        """Commits the turn's answer and so ends the stream (``streamEnd`` committed).

        ``frames`` are the frames to store, as for :meth:`Turn.reply <converger.Turn.reply>`;
        each frame with neither ``id`` nor ``streamId`` gets ``streamId``, so the server stores
        it with the stream's id as its ``id`` (a UI that keyed the streamed bubble by it
        replaces that bubble). ``None`` commits one ``text`` frame holding everything
        streamed so far (:attr:`streamed_text`; it must then not be empty, and fit
        ``maxTextBytes``). ``runtime`` is written as for ``reply()``.

        The answer is resent with the turn's clientId until acknowledged, also after a
        reconnect, so it commits even when the connection dropped mid-stream. Chunk refusals
        are not raised here: the turn registry decides, raising
        :class:`~converger.LeaseLost`, :class:`~converger.TurnSuperseded`,
        :class:`~converger.TurnConflict`, :class:`~converger.StaleRuntime` or
        :class:`~converger.ServerError` as ``reply()`` does. After
        :class:`~converger.StaleRuntime`, :class:`~converger.FrameTooLarge` (nothing sent) or
        :class:`ValueError`, the stream stays open: call ``finish()`` again or :meth:`abort`.
        """
        self._require_open()
        async with self._lock:
            self._require_open()
            if frames is None:
                if not self._parts:
                    raise ValueError(
                        f"stream {self._stream_id} streamed no text: pass the frames to commit"
                    )
                bodies: list[JSONObject] = [{"type": "text", "data": {"text": self.streamed_text}}]
            else:
                bodies = frames_of(frames)
            for body in bodies:
                if "id" not in body and "streamId" not in body:
                    body["streamId"] = self._stream_id
            self._state = "finished"
            try:
                ack = await self._turn.reply(bodies, runtime, timeout=timeout)
            except (FrameTooLarge, StaleRuntime, ValueError, TypeError):
                # Nothing was stored and the server keeps the stream open: finish again
                # (against the current runtime, for StaleRuntime), or abort.
                self._state = "open"
                raise
            except BaseException:
                self._agent._forget_stream(self)
                raise
            self._agent._forget_stream(self)
            self._ack = ack
            return ack

    async def abort(self, reason: str = "agent") -> None:
        """Ends the stream without an answer (``streamEnd`` aborted with ``reason``).

        ``reason`` is shown to end users (the server keeps 64 characters). Nothing is sent
        when the stream never opened or the server already aborted it (its connection
        dropped). The turn stays unanswered; answer it with ``turn.reply()`` or a new
        ``turn.stream()``. A second abort does nothing; an abort after :meth:`finish` raises
        :class:`RuntimeError`.
        """
        async with self._lock:
            if self._state == "aborted":
                return
            self._require_open()
            self._state = "aborted"
            self._agent._forget_stream(self)
            if self._index > 0 and self._opened_on == self._agent.connections:
                frame = {"type": "streamAbort", "streamId": self._stream_id, "reason": reason}
                await self._agent._write_enveloped(self.conversation_id, frame)

    async def __aenter__(self) -> AnswerStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._state != "open":
            return
        if self._turn.cancelled:
            # The stop ended the stream for every viewer already.
            self._state = "aborted"
            self._agent._forget_stream(self)
            return
        if exc is not None:
            with contextlib.suppress(Exception):
                await self.abort("error")
            return
        if self._turn.ack is not None:
            # The turn was answered with turn.reply(): its result ended this stream.
            self._state = "finished"
            self._agent._forget_stream(self)
            return
        if self._raised is not None:
            log.warning(
                "stream %s ended after %r without finish(): aborted, turn %s left unanswered",
                self._stream_id,
                self._raised,
                self._turn.key,
            )
            await self.abort("error")
            return
        if not self._parts:
            await self.abort("error")
            raise ValueError(
                f"stream {self._stream_id} ended without finish() and streamed no text: "
                "call finish(frames) or abort()"
            )
        await self.finish()

    # --- internals -----------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"stream {self._stream_id} is {self._state}")

    def _refused(self, error: ServerError) -> None:
        """Records the server's refusal of a chunk (called by the agent's reader)."""
        if self._refusal is None:
            self._refusal = error
            log.warning("stream %s refused: %s", self._stream_id, error)

    def _fail(self, error: BaseException) -> BaseException:
        self._raised = error
        return error

    async def _send(self, field: str, content: Any) -> None:
        self._require_open()
        async with self._lock:
            self._require_open()
            agent = self._agent
            agent._require_alive()
            if self._refusal is not None:
                raise self._fail(self._refusal)
            connection = agent.connections
            if not agent.connected:
                raise self._fail(
                    StreamInterrupted(self.conversation_id, self._stream_id, "not connected")
                )
            if self._opened_on is not None and connection != self._opened_on:
                raise self._fail(
                    StreamInterrupted(
                        self.conversation_id,
                        self._stream_id,
                        "the connection dropped since the stream opened; the server aborted it",
                    )
                )
            frame: JSONObject = {
                "type": "streamChunk",
                "streamId": self._stream_id,
                "index": self._index,
            }
            if self._index == 0:
                turn: JSONObject = {"seq": self._turn.seq, "revision": self._turn.revision}
                if self._turn.fence is not None:
                    turn["fence"] = self._turn.fence
                frame["turn"] = turn
            frame[field] = content
            text = dumps({"conversationId": self.conversation_id, "frame": frame})
            limit = agent.welcome.limits.max_frame_bytes
            size = len(text.encode())
            if size > limit:
                raise FrameTooLarge(size, limit)
            if not await agent._write(text):
                raise self._fail(
                    StreamInterrupted(
                        self.conversation_id, self._stream_id, "the connection dropped"
                    )
                )
            if self._index == 0:
                self._opened_on = connection
            self._index += 1
            if field == "text":
                self._parts.append(content)


# --- The end user's side -----------------------------------------------------------------------


class AssembledStream:
    """One stream as an end user has assembled it so far (updated in place).

    ``text`` is the text deltas joined, ``chunks`` the genui chunk objects in order,
    ``next_index`` the number of chunks applied (the next index expected). ``status`` is
    ``open``, ``committed`` or ``aborted`` (``reason`` says why); ``duplicates`` counts the
    chunks that arrived again (after a reconnect) and were dropped. ``turn`` and ``sender``
    come from the first chunk.
    """

    __slots__ = (
        "_parts",
        "_text",
        "_text_ends",
        "chunks",
        "duplicates",
        "next_index",
        "reason",
        "sender",
        "status",
        "stream_id",
        "turn",
    )

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.turn: TurnRef | None = None
        self.sender: Participant | None = None
        self.chunks: list[JSONObject] = []
        self.next_index = 0
        self.status: Literal["open", "committed", "aborted"] = "open"
        self.reason: str | None = None
        self.duplicates = 0
        self._parts: list[str] = []
        self._text: str | None = ""
        # Per chunk applied: the length of the text up to its end, so a coalesced chunk that
        # overlaps what was applied adds only the rest.
        self._text_ends: list[int] = []

    @property
    def text(self) -> str:
        """The text deltas applied so far, joined."""
        if self._text is None:
            self._text = "".join(self._parts)
        return self._text

    @property
    def ended(self) -> bool:
        """Whether the stream ended (committed or aborted)."""
        return self.status != "open"

    @property
    def committed(self) -> bool:
        """Whether the stream ended with its answer stored."""
        return self.status == "committed"

    def __repr__(self) -> str:
        return (
            f"AssembledStream({self.stream_id!r}, status={self.status!r}, "
            f"next_index={self.next_index}, text={self.text!r})"
        )


@dataclass(frozen=True, slots=True)
class StreamUpdate:
    """What changed in a stream: a chunk was applied (``chunk``) or the stream ended (``end``).

    ``stream`` is the stream's :class:`AssembledStream`, live: it may already hold later
    chunks when this update is read late. Repeated chunks never produce an update, and each
    stream produces one update with ``end``.
    """

    stream: AssembledStream
    chunk: StreamChunk | None = None
    end: StreamEnd | None = None

    @property
    def stream_id(self) -> str:
        """The stream's id."""
        return self.stream.stream_id


class StreamAssembly:
    """The streams of one conversation as an end user's UI shows them, each chunk once.

    A new connection is shown every open stream from index 0 again, so keep one assembly
    across reconnects (:class:`~converger.Conversation` does): :meth:`apply_chunk` applies a
    chunk only when its index is the next one of its stream, so repeats are dropped and a gap
    is never papered over. A stream ends with its ``streamEnd`` (:meth:`apply_end`) or with
    the stored answer that names it (:meth:`apply_message`), whichever comes first. A stream
    that was aborted while this client was disconnected stays ``open`` here: the server
    shows a new connection only the streams still open.

    At most ``max_ended`` ended streams are kept (the oldest go first); open ones are all kept.
    """

    def __init__(self, max_ended: int = 1000) -> None:
        self._streams: dict[str, AssembledStream] = {}
        self._ended: deque[str] = deque()
        self._max_ended = max(max_ended, 1)

    def apply_chunk(self, chunk: StreamChunk) -> AssembledStream | None:
        """Applies ``chunk``; the stream when it was applied, ``None`` for a repeat or a gap.

        A coalesced chunk (``first_index`` below ``index``) that covers chunks applied already
        adds only the text after them.
        """
        stream = self._streams.get(chunk.stream_id)
        if stream is None:
            if chunk.first_index != 0:
                return None
            stream = AssembledStream(chunk.stream_id)
            self._streams[chunk.stream_id] = stream
        following = stream.next_index
        if stream.ended or chunk.index < following or chunk.first_index > following:
            if chunk.index < following:
                stream.duplicates += 1
            return None
        if following == 0:
            stream.turn = chunk.turn
            stream.sender = chunk.sender
        # chunks of the range that were applied already arrived again: their text is dropped
        stream.duplicates += following - chunk.first_index
        held_length = stream._text_ends[-1] if stream._text_ends else 0
        if chunk.text is not None:
            run_start = stream._text_ends[chunk.first_index - 1] if chunk.first_index > 0 else 0
            new_text = chunk.text[held_length - run_start :]
            if new_text:
                stream._parts.append(new_text)
                stream._text = None
            held_length += len(new_text)
        if chunk.chunk is not None:
            stream.chunks.append(chunk.chunk)
        stream._text_ends.extend([held_length] * (chunk.index + 1 - following))
        stream.next_index = chunk.index + 1
        return stream

    def apply_end(self, end: StreamEnd) -> AssembledStream | None:
        """Ends a stream; the stream when this ended one that was shown, else ``None``.

        ``None`` when the stream had ended already, or when none of it had arrived: such an
        end is recorded (so that chunks arriving later are dropped) but there is nothing to
        show.
        """
        stream = self._streams.get(end.stream_id)
        shown = stream is not None
        if stream is None:
            stream = AssembledStream(end.stream_id)
            self._streams[end.stream_id] = stream
        elif stream.ended:
            return None
        stream.status = end.status
        stream.reason = end.reason
        self._ended.append(end.stream_id)
        while len(self._ended) > self._max_ended:
            self._streams.pop(self._ended.popleft(), None)
        return stream if shown else None

    def apply_message(self, message: Message) -> AssembledStream | None:
        """Ends, as committed, the open stream a stored answer names; ``None`` when none.

        The stored answer names its stream with ``streamId`` (and, unless the agent gave it
        another id, has the stream's id as its ``id``).
        """
        named = message.raw.get("streamId")
        for stream_id in (named, message.id):
            if not isinstance(stream_id, str):
                continue
            stream = self._streams.get(stream_id)
            if stream is not None and not stream.ended:
                return self.apply_end(StreamEnd(stream_id, "committed", None, message.raw))
        return None

    def get(self, stream_id: str) -> AssembledStream | None:
        """A stream, when any of it arrived (or its end)."""
        return self._streams.get(stream_id)

    @property
    def open(self) -> list[AssembledStream]:
        """The streams that have not ended, oldest first."""
        return [stream for stream in self._streams.values() if not stream.ended]

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._streams

    def __iter__(self) -> Iterator[AssembledStream]:
        return iter(list(self._streams.values()))

    def __len__(self) -> int:
        return len(self._streams)
