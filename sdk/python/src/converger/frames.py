"""Typed views of the frames the server sends (``docs/protocol.md``).

Every object keeps the decoded frame in ``raw`` (or ``frame``), so fields this SDK does not
model yet stay reachable; unknown fields are ignored, as the protocol asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ._json import JSONObject, as_int, as_object, as_str
from .errors import ServerError

__all__ = [
    "Abort",
    "Ack",
    "AgentEvent",
    "Catalog",
    "ClientSkills",
    "ClientTools",
    "ConversationEvent",
    "ConversationMessage",
    "DeliveryStatus",
    "ErrorEvent",
    "ForwardedFrame",
    "GenuiEvent",
    "Interrupt",
    "Limits",
    "Message",
    "OtherFrame",
    "Participant",
    "Presence",
    "PresenceChange",
    "ReadReceipt",
    "Reconnected",
    "ReplayTruncated",
    "ReplyAck",
    "Resume",
    "RunStatus",
    "Runtime",
    "StreamChunk",
    "StreamEnd",
    "Survey",
    "TokenRefreshed",
    "TurnRef",
    "Typing",
    "UnknownFrame",
    "UserTyping",
    "Welcome",
]

SERVER_CONTROL_TYPES = frozenset(
    {
        "welcome",
        "ack",
        "error",
        "heartbeat",
        "replayTruncated",
        "deliveryStatus",
        "presence",
        "tokenRefreshed",
        "typing",
        "run",
        "genui_components",
        "skills",
        "streamChunk",
        "streamEnd",
    }
)
"""Frame types that are never persistent messages, even when they carry a ``seq``."""

FORWARDED_TYPES = frozenset(
    {"resume", "abort", "genui_event", "client_tools", "client_skills", "survey"}
)
"""Client frames the server hands to agents as sent (``docs/protocol.md`` §3.2)."""


@dataclass(frozen=True, slots=True)
class Participant:
    """Who wrote or did something: ``{"id": "alice", "role": "user"}``."""

    id: str
    role: str

    @staticmethod
    def parse(value: object) -> Participant | None:
        """A participant from its JSON object, or ``None``."""
        fields = as_object(value)
        ident, role = as_str(fields.get("id")), as_str(fields.get("role"))
        if ident is None or role is None:
            return None
        return Participant(ident, role)


@dataclass(frozen=True, slots=True)
class Runtime:
    """A conversation's runtime: a JSON ``state`` and its integer ``version``.

    Only an answer (``turnResult``) writes it: the answer names the version it read and the
    commit increments it (``docs/protocol.md`` §5.6).
    """

    version: int = 0
    state: JSONObject = field(default_factory=dict)

    @staticmethod
    def parse(value: object) -> Runtime:
        """The runtime of a delivered turn's ``meta.runtime`` (``{0, {}}`` when absent)."""
        fields = as_object(value)
        return Runtime(as_int(fields.get("version")) or 0, dict(as_object(fields.get("state"))))

    def to_json(self) -> JSONObject:
        """The wire form ``{"version": …, "state": …}``."""
        return {"version": self.version, "state": self.state}


@dataclass(frozen=True, slots=True)
class TurnRef:
    """A turn revision: ``(seq, revision)``, as acks and refusals name it."""

    seq: int
    revision: int

    @staticmethod
    def parse(value: object) -> TurnRef | None:
        """From ``{"seq": …, "revision": …}``, or ``None``."""
        fields = as_object(value)
        seq = as_int(fields.get("seq"))
        if seq is None:
            return None
        return TurnRef(seq, as_int(fields.get("revision")) or 0)


@dataclass(frozen=True, slots=True)
class Message:
    """A persistent frame: committed, with a gap-free per-conversation ``seq``.

    ``from_`` is the wire's ``from`` (``"user"`` or ``"bot"``, relative to the end user);
    ``client_id`` is present on the viewing user's own frames; ``replaces`` on an edit is the
    seq of the edited turn. ``raw`` is the whole frame (``actions``, ``streamId``, … included).
    """

    type: str
    id: str
    seq: int
    from_: str | None
    sender: Participant | None
    data: JSONObject
    timestamp: int | None
    metadata: JSONObject | None
    client_id: str | None
    replaces: int | None
    raw: JSONObject

    @property
    def text(self) -> str | None:
        """``data.text`` when it is a string (``text`` frames)."""
        return as_str(self.data.get("text"))

    @staticmethod
    def parse(frame: JSONObject) -> Message | None:
        """A persistent frame, or ``None`` for anything without a ``seq`` or of a control type."""
        kind = as_str(frame.get("type"))
        seq = as_int(frame.get("seq"))
        if kind is None or seq is None or kind in SERVER_CONTROL_TYPES:
            return None
        metadata = frame.get("metadata")
        return Message(
            type=kind,
            id=as_str(frame.get("id")) or "",
            seq=seq,
            from_=as_str(frame.get("from")),
            sender=Participant.parse(frame.get("sender")),
            data=as_object(frame.get("data")),
            timestamp=as_int(frame.get("timestamp")),
            metadata=metadata if isinstance(metadata, dict) else None,
            client_id=as_str(frame.get("clientId")),
            replaces=as_int(frame.get("replaces")),
            raw=frame,
        )


@dataclass(frozen=True, slots=True)
class Ack:
    """The server's ack of a keyed send (a message, ``edit``, ``regenerate``, proactive frame).

    ``seq`` and ``id`` are the stored frame's (absent for ``regenerate``, which stores nothing
    until answered); ``turn`` is the revision an ``edit`` or ``regenerate`` opened;
    ``duplicate`` is true when an earlier send with the same clientId was already stored.
    """

    client_id: str | None
    id: str | None
    seq: int | None
    timestamp: int | None
    duplicate: bool
    turn: TurnRef | None
    raw: JSONObject

    @staticmethod
    def parse(frame: JSONObject) -> Ack:
        """From an ``ack`` frame."""
        return Ack(
            client_id=as_str(frame.get("clientId")),
            id=as_str(frame.get("id")),
            seq=as_int(frame.get("seq")),
            timestamp=as_int(frame.get("timestamp")),
            duplicate=frame.get("duplicate") is True,
            turn=TurnRef.parse(frame.get("turn")),
            raw=frame,
        )


@dataclass(frozen=True, slots=True)
class ReplyAck:
    """The ack of a turn's answer (``turnResult``).

    ``seqs`` and ``ids`` are the stored frames'; ``duplicate`` is true when this answer was
    already committed by an earlier send (a resend after a lost ack, say).
    """

    client_id: str | None
    turn: TurnRef | None
    ids: list[str]
    seqs: list[int]
    timestamp: int | None
    duplicate: bool
    raw: JSONObject

    @staticmethod
    def parse(frame: JSONObject) -> ReplyAck:
        """From an enveloped ``ack`` frame answering a ``turnResult``."""
        ids = frame.get("ids")
        seqs = frame.get("seqs")
        return ReplyAck(
            client_id=as_str(frame.get("clientId")),
            turn=TurnRef.parse(frame.get("turn")),
            ids=[item for item in ids if isinstance(item, str)] if isinstance(ids, list) else [],
            seqs=(
                [seq for seq in (as_int(item) for item in seqs) if seq is not None]
                if isinstance(seqs, list)
                else []
            ),
            timestamp=as_int(frame.get("timestamp")),
            duplicate=frame.get("duplicate") is True,
            raw=frame,
        )


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits a ``welcome`` announces (the values the node enforces)."""

    max_frame_bytes: int = 65536
    max_text_bytes: int = 16384
    max_metadata_bytes: int = 4096
    max_in_flight: int = 32
    heartbeat_interval_ms: int = 25000
    idle_timeout_ms: int = 60000
    replay_batch: int = 200
    replay_max: int = 1000
    max_conversations: int | None = None
    max_stream_bytes: int | None = None
    """Bytes one streamed answer's chunks may hold (text bytes, or each chunk object's JSON)."""
    max_streams_per_connection: int | None = None
    """Streams one agent connection may have open at once (channel scope only)."""

    @staticmethod
    def parse(value: object) -> Limits:
        """From ``welcome.data.limits`` (defaults for missing keys)."""
        fields = as_object(value)
        base = Limits()

        def pick(key: str, default: int) -> int:
            number = as_int(fields.get(key))
            return default if number is None else number

        return Limits(
            max_frame_bytes=pick("maxFrameBytes", base.max_frame_bytes),
            max_text_bytes=pick("maxTextBytes", base.max_text_bytes),
            max_metadata_bytes=pick("maxMetadataBytes", base.max_metadata_bytes),
            max_in_flight=pick("maxInFlight", base.max_in_flight),
            heartbeat_interval_ms=pick("heartbeatIntervalMs", base.heartbeat_interval_ms),
            idle_timeout_ms=pick("idleTimeoutMs", base.idle_timeout_ms),
            replay_batch=pick("replayBatch", base.replay_batch),
            replay_max=pick("replayMax", base.replay_max),
            max_conversations=as_int(fields.get("maxConversations")),
            max_stream_bytes=as_int(fields.get("maxStreamBytes")),
            max_streams_per_connection=as_int(fields.get("maxStreamsPerConnection")),
        )


@dataclass(frozen=True, slots=True)
class Interrupt:
    """An open interrupt of a conversation (``welcome.data.pending``): ``{id, data}``."""

    id: str
    data: JSONObject


@dataclass(frozen=True, slots=True)
class Welcome:
    """``welcome.data`` of one connection.

    Channel scope (agents) has ``channel_id``, ``group`` (members), ``since`` (the member's
    eligibility time, ms epoch of the node's clock) and, in lease mode, ``claim`` and
    ``lease_ms``. Conversation scope (end users) has ``conversation_id``, ``user_id``,
    ``watermark`` (the head when the session subscribed) and ``pending`` interrupts.
    """

    protocol: str | None
    scope: str | None
    connection_id: str
    expires_at: int | None
    limits: Limits
    capabilities: JSONObject
    channel_id: str | None
    group: str | None
    since: int | None
    claim: str | None
    lease_ms: int | None
    conversation_id: str | None
    user_id: str | None
    watermark: int | None
    pending: list[Interrupt]
    raw: JSONObject

    @property
    def streams(self) -> bool:
        """Whether the node supports streamed answers (``capabilities.streams``)."""
        return self.capabilities.get("streams") is True

    @staticmethod
    def parse(data: object) -> Welcome:
        """From ``welcome.data``."""
        fields = as_object(data)
        pending: list[Interrupt] = []
        raw_pending = fields.get("pending")
        if isinstance(raw_pending, list):
            for item in raw_pending:
                entry = as_object(item)
                ident = as_str(entry.get("id"))
                if ident is not None:
                    pending.append(Interrupt(ident, as_object(entry.get("data"))))
        return Welcome(
            protocol=as_str(fields.get("protocol")),
            scope=as_str(fields.get("scope")),
            connection_id=as_str(fields.get("connectionId")) or "",
            expires_at=as_int(fields.get("expiresAt")),
            limits=Limits.parse(fields.get("limits")),
            capabilities=as_object(fields.get("capabilities")),
            channel_id=as_str(fields.get("channelId")),
            group=as_str(fields.get("group")),
            since=as_int(fields.get("since")),
            claim=as_str(fields.get("claim")),
            lease_ms=as_int(fields.get("leaseMs")),
            conversation_id=as_str(fields.get("conversationId")),
            user_id=as_str(fields.get("userId")),
            watermark=as_int(fields.get("watermark")),
            pending=pending,
            raw=fields,
        )


# --- What an agent receives besides turns ------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentEvent:
    """Something an agent receives that is not a turn; ``frame`` is the delivered frame."""

    conversation_id: str
    frame: JSONObject


@dataclass(frozen=True, slots=True)
class ForwardedFrame(AgentEvent):
    """A client frame the end user sent for the agents, handed over as sent (transient).

    The subclasses name the six forwarded types; ``client_id`` and ``data`` are the frame's.
    """

    type: str
    client_id: str | None
    data: JSONObject


@dataclass(frozen=True, slots=True)
class Resume(ForwardedFrame):
    """``resume``: the user answers an interrupt (the ``data`` shape is the application's)."""


@dataclass(frozen=True, slots=True)
class Abort(ForwardedFrame):
    """``abort``: the user asks the agent to stop what it is doing."""


@dataclass(frozen=True, slots=True)
class GenuiEvent(ForwardedFrame):
    """``genui_event``: an interaction with generated UI."""


@dataclass(frozen=True, slots=True)
class ClientTools(ForwardedFrame):
    """``client_tools``: tools the client offers."""


@dataclass(frozen=True, slots=True)
class ClientSkills(ForwardedFrame):
    """``client_skills``: skills the client offers."""


@dataclass(frozen=True, slots=True)
class Survey(ForwardedFrame):
    """``survey``: a survey answer."""


@dataclass(frozen=True, slots=True)
class UserTyping(AgentEvent):
    """An end user's ``typing`` (``sender`` is the user)."""

    is_typing: bool
    sender: Participant | None


@dataclass(frozen=True, slots=True)
class ReadReceipt(AgentEvent):
    """A ``deliveryStatus``: ``by`` has read up to ``up_to_seq``."""

    up_to_seq: int | None
    status: str | None
    by: Participant | None


@dataclass(frozen=True, slots=True)
class PresenceChange(AgentEvent):
    """A ``presence``: ``participant`` came ``online`` or went ``offline`` (per node)."""

    participant: Participant | None
    status: str | None
    connections: int | None


@dataclass(frozen=True, slots=True)
class ConversationMessage(AgentEvent):
    """A persistent frame that is not a turn for this agent.

    Another party's answer or proactive frame, a channel-scope REST post, or anything an
    observer sees.
    """

    message: Message


@dataclass(frozen=True, slots=True)
class OtherFrame(AgentEvent):
    """An enveloped frame of a type this SDK does not model."""


_FORWARDED_CLASSES: dict[str, type[ForwardedFrame]] = {
    "resume": Resume,
    "abort": Abort,
    "genui_event": GenuiEvent,
    "client_tools": ClientTools,
    "client_skills": ClientSkills,
    "survey": Survey,
}


def parse_agent_event(conversation_id: str, frame: JSONObject) -> AgentEvent:
    """The typed event for an enveloped frame that is not a turn, ack or error."""
    kind = as_str(frame.get("type")) or ""
    forwarded = _FORWARDED_CLASSES.get(kind)
    if forwarded is not None:
        return forwarded(
            conversation_id,
            frame,
            kind,
            as_str(frame.get("clientId")),
            as_object(frame.get("data")),
        )
    if kind == "typing":
        return UserTyping(
            conversation_id,
            frame,
            frame.get("isTyping") is True,
            Participant.parse(frame.get("sender")),
        )
    data = as_object(frame.get("data"))
    if kind == "deliveryStatus":
        return ReadReceipt(
            conversation_id,
            frame,
            as_int(data.get("upToSeq")),
            as_str(data.get("status")),
            Participant.parse(data.get("by")),
        )
    if kind == "presence":
        return PresenceChange(
            conversation_id,
            frame,
            Participant.parse(data.get("participant")),
            as_str(data.get("status")),
            as_int(data.get("connections")),
        )
    message = Message.parse(frame)
    if message is not None:
        return ConversationMessage(conversation_id, frame, message)
    return OtherFrame(conversation_id, frame)


# --- What an end user receives besides persistent frames ---------------------------------


@dataclass(frozen=True, slots=True)
class Typing:
    """``typing``: an agent (no ``sender``) or another participant types or stopped."""

    is_typing: bool
    sender: Participant | None
    raw: JSONObject


@dataclass(frozen=True, slots=True)
class RunStatus:
    """``run``: an agent's status frame, ``data`` as the agent sent it."""

    data: JSONObject
    raw: JSONObject


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """An ``error`` frame that does not answer a send of this client.

    An agent's relayed error (``busy``, …), ``bot_unavailable`` for a forwarded frame,
    ``invalid_watermark``, …
    """

    error: ServerError
    raw: JSONObject


@dataclass(frozen=True, slots=True)
class DeliveryStatus:
    """``deliveryStatus``: ``by`` has read up to ``up_to_seq``."""

    up_to_seq: int | None
    status: str | None
    by: Participant | None
    raw: JSONObject


@dataclass(frozen=True, slots=True)
class Presence:
    """``presence`` of a participant (per node)."""

    participant: Participant | None
    status: str | None
    connections: int | None
    raw: JSONObject


@dataclass(frozen=True, slots=True)
class Reconnected:
    """The connection was re-established: the replay and the resends follow."""

    welcome: Welcome


@dataclass(frozen=True, slots=True)
class ReplayTruncated:
    """The replay stopped at ``watermark`` below ``head_seq``; the client syncs the rest."""

    watermark: int | None
    head_seq: int | None
    raw: JSONObject


@dataclass(frozen=True, slots=True)
class Catalog:
    """A catalog the channel's agents published (``genui_components`` or ``skills``)."""

    kind: Literal["genui_components", "skills"]
    hash: str | None
    unchanged: bool
    raw: JSONObject


@dataclass(frozen=True, slots=True)
class TokenRefreshed:
    """``tokenRefreshed``: the token sent with ``auth`` was accepted."""

    expires_at: int | None
    raw: JSONObject


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """``streamChunk``: one chunk of an answer an agent is streaming (transient, never stored).

    ``index`` counts from 0 within the stream ``stream_id``; ``turn`` is the turn answered and
    ``sender`` the writing agent (the wire's ``from``). A chunk carries either ``text`` (a
    delta to append) or ``chunk`` (a genui chunk object, shown as it is). A new connection is
    shown every open stream from index 0 again, each run of text chunks coalesced into one
    chunk that covers ``first_index`` to ``index`` (the wire's ``firstIndex``; equal to
    ``index`` for a single chunk): assemble with a :class:`~converger.StreamAssembly`, which
    applies each index once.
    """

    stream_id: str
    index: int
    first_index: int
    turn: TurnRef | None
    sender: Participant | None
    text: str | None
    chunk: JSONObject | None
    raw: JSONObject

    @staticmethod
    def parse(frame: JSONObject) -> StreamChunk | None:
        """From a ``streamChunk`` frame; ``None`` when ``streamId`` or ``index`` is missing."""
        stream_id = as_str(frame.get("streamId"))
        index = as_int(frame.get("index"))
        if stream_id is None or index is None or index < 0:
            return None
        first_index = as_int(frame.get("firstIndex"))
        if first_index is None:
            first_index = index
        if first_index < 0 or first_index > index:
            return None
        chunk = frame.get("chunk")
        return StreamChunk(
            stream_id=stream_id,
            index=index,
            first_index=first_index,
            turn=TurnRef.parse(frame.get("turn")),
            sender=Participant.parse(frame.get("from")),
            text=as_str(frame.get("text")),
            chunk=chunk if isinstance(chunk, dict) else None,
            raw=frame,
        )


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """``streamEnd``: a stream ended, ``committed`` (its answer is stored) or ``aborted``.

    ``reason`` says why it was aborted (``stopped``, ``superseded``, ``user_disconnected`` or
    ``conversation_closed`` for a stopped turn,
    ``disconnected``, ``node_down``, ``too_large``, ``fenced``, ``conflict``, the agent's own
    reason, …). The committed answer and the
    ``streamEnd`` may arrive in either order. ``raw`` is the frame that ended the stream: the
    ``streamEnd``, or the stored answer when a :class:`~converger.StreamAssembly` ended the
    stream on seeing it.
    """

    stream_id: str
    status: Literal["committed", "aborted"]
    reason: str | None
    raw: JSONObject

    @property
    def committed(self) -> bool:
        """Whether the stream ended with its answer stored."""
        return self.status == "committed"

    @staticmethod
    def parse(frame: JSONObject) -> StreamEnd | None:
        """From a ``streamEnd`` frame; ``None`` when ``streamId`` or ``status`` is missing."""
        stream_id = as_str(frame.get("streamId"))
        status = as_str(frame.get("status"))
        if stream_id is None or status not in ("committed", "aborted"):
            return None
        return StreamEnd(
            stream_id,
            "committed" if status == "committed" else "aborted",
            as_str(frame.get("reason")),
            frame,
        )


@dataclass(frozen=True, slots=True)
class UnknownFrame:
    """A frame of a type this SDK does not model."""

    raw: JSONObject


ConversationEvent = (
    Typing
    | RunStatus
    | ErrorEvent
    | DeliveryStatus
    | Presence
    | Reconnected
    | ReplayTruncated
    | Catalog
    | TokenRefreshed
    | UnknownFrame
)
"""Everything :meth:`converger.Conversation.events` yields."""
