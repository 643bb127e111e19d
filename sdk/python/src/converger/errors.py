"""The exceptions of the SDK.

Everything raised on purpose derives from :class:`ConvergerError`:

- :class:`ServerError` is an ``error`` frame of the server (``docs/protocol.md`` §7) that refused
  something this client sent; the agent refusals have their own subclasses
  (:class:`TurnConflict`, :class:`TurnSuperseded`, :class:`StaleRuntime`, :class:`LeaseLost`),
  and so do the refusals of streamed answers (:class:`StreamClosed`, :class:`TooManyStreams`).
- :class:`FatalClose` ends a connection for good: the server closed it with a code that a new
  connection would get again (4400, 4401, 4403, 1009) or refused the upgrade with a 4xx status.
- :class:`RestError` and its subclasses are the REST API's ``{"error": {"code", "message"}}``.
- :class:`AckTimeout`, :class:`ClientClosed`, :class:`GaveUp`, :class:`FrameTooLarge` and
  :class:`StreamInterrupted` are decided by the client itself.
"""

from __future__ import annotations

from typing import Any

from ._json import JSONObject, as_int, as_object, as_str

__all__ = [
    "AckTimeout",
    "AuthenticationError",
    "ClientClosed",
    "ConflictError",
    "ConvergerError",
    "FatalClose",
    "FrameTooLarge",
    "GaveUp",
    "InternalServerError",
    "InvalidRequestError",
    "LeaseLost",
    "NotFoundError",
    "PermissionDeniedError",
    "RestError",
    "ServerError",
    "ServiceUnavailableError",
    "StaleRuntime",
    "StreamClosed",
    "StreamInterrupted",
    "TooManyStreams",
    "TurnConflict",
    "TurnInProgress",
    "TurnStopped",
    "TurnSuperseded",
]


class ConvergerError(Exception):
    """Base class of every exception this SDK raises on purpose."""


class ServerError(ConvergerError):
    """An ``error`` frame from the server, refusing a frame this client sent.

    Attributes mirror the frame's ``data``: ``code`` (``"turn_conflict"``, ``"internal"``, …),
    ``message``, ``number``, ``retryable``, ``retry_after_ms``, ``details``, ``client_id`` and
    ``frame_type`` (the refused frame's type); ``data`` is the whole object.
    """

    code: str
    message: str
    number: int | None
    retryable: bool
    retry_after_ms: int | None
    details: JSONObject
    client_id: str | None
    frame_type: str | None
    data: JSONObject

    def __init__(self, data: JSONObject) -> None:
        self.data = dict(data)
        self.code = as_str(data.get("code")) or "unknown"
        self.message = as_str(data.get("message")) or ""
        self.number = as_int(data.get("number"))
        self.retryable = data.get("retryable") is True
        self.retry_after_ms = as_int(data.get("retryAfterMs"))
        self.details = as_object(data.get("details"))
        self.client_id = as_str(data.get("clientId"))
        self.frame_type = as_str(data.get("frameType"))
        text = f"{self.code}: {self.message}" if self.message else self.code
        if self.details:
            text = f"{text} {self.details}"
        super().__init__(text)

    @property
    def stream_id(self) -> str | None:
        """The stream a refused ``streamChunk`` or ``streamAbort`` names (``details.streamId``)."""
        return as_str(self.details.get("streamId"))

    @property
    def index(self) -> int | None:
        """The index of the refused ``streamChunk`` (``details.index``), when given."""
        return as_int(self.details.get("index"))

    @staticmethod
    def from_data(data: object) -> ServerError:
        """The exception for an error frame's ``data``, of the subclass its ``code`` names."""
        fields = as_object(data)
        kind = _BY_CODE.get(as_str(fields.get("code")) or "", ServerError)
        return kind(fields)


class TurnConflict(ServerError):
    """``turn_conflict``: another answer is already committed for this turn revision.

    ``committed_seqs`` are the seqs of the answer that counts. Drop the reply.
    """

    @property
    def committed_seqs(self) -> list[int]:
        """The seqs of the committed answer (``details.seqs``)."""
        seqs = self.details.get("seqs")
        if not isinstance(seqs, list):
            return []
        return [seq for seq in (as_int(item) for item in seqs) if seq is not None]


class TurnSuperseded(ServerError):
    """``turn_superseded``: the user edited or regenerated the turn; a newer revision exists.

    The newer revision is delivered as a turn of its own; drop this reply.
    """

    @property
    def latest_revision(self) -> int | None:
        """The turn's latest revision (``details.revision``)."""
        return as_int(self.details.get("revision"))


class StaleRuntime(ServerError):
    """``stale_runtime``: the reply's ``runtime.version`` is not the conversation's current one.

    Someone else wrote the runtime since the turn was read; nothing was stored. Build the
    answer again on the current state (``agent.sync`` brings the turn back with it).
    """

    @property
    def current_version(self) -> int | None:
        """The conversation's current runtime version (``details.version``)."""
        return as_int(self.details.get("version"))


class LeaseLost(ServerError):
    """``lease_lost`` (lease mode): another worker claimed the turn since this delivery.

    Nothing was stored. Stop working on the turn and do not retry: the new holder does the
    work, with the same turn key for its external calls.
    """

    @property
    def current_fence(self) -> int | None:
        """The turn's current fence (``details.fence``)."""
        return as_int(self.details.get("fence"))


class StreamClosed(ServerError):
    """``stream_closed``: a chunk for a stream that has ended or that another connection writes.

    Also the answer to a stream opened for a turn that is answered already. Stop streaming;
    a turn answered already needs no answer from this agent.
    """


class TooManyStreams(ServerError):
    """``too_many_streams``: this connection has ``maxStreamsPerConnection`` streams open.

    The refused stream was never shown. Finish or abort other streams, or answer this turn
    with :meth:`~converger.Turn.reply` (or :meth:`~converger.AnswerStream.finish`) instead.
    """


class TurnStopped(ServerError):
    """``turn_stopped``: the end user stopped the turn and the gateway settled it.

    The turn's result is what was streamed before the stop; this answer came after the grace
    period (``turns.stop_grace_ms``) and is not stored. A handler cancelled on ``cancel`` never
    gets here.
    """


class TurnInProgress(ServerError):
    """``turn_in_progress``: the channel's turn policy is ``reject`` and a turn is running.

    Nothing was stored. Send again once the turn is answered (or stop it first).
    """

    @property
    def running_seq(self) -> int | None:
        """The running turn's seq (``details.turn.seq``)."""
        return as_int(as_object(self.details.get("turn")).get("seq"))


_BY_CODE: dict[str, type[ServerError]] = {
    "turn_conflict": TurnConflict,
    "turn_superseded": TurnSuperseded,
    "stale_runtime": StaleRuntime,
    "lease_lost": LeaseLost,
    "stream_closed": StreamClosed,
    "too_many_streams": TooManyStreams,
    "turn_stopped": TurnStopped,
    "turn_in_progress": TurnInProgress,
}


class FatalClose(ConvergerError):
    """The connection ended in a way a new connection would meet again; no reconnect follows.

    ``close_code`` is the WebSocket close code (4400 protocol, 4401 auth, 4403 channel
    inactive, 1009 message too big) or ``None`` when the HTTP upgrade itself was refused with
    ``http_status``. ``error`` is the ``error`` frame that came before the close, if any.
    """

    def __init__(
        self,
        close_code: int | None,
        reason: str = "",
        error: ServerError | None = None,
        http_status: int | None = None,
    ) -> None:
        self.close_code = close_code
        self.reason = reason
        self.error = error
        self.http_status = http_status
        if close_code is not None:
            text = f"connection closed for good: {close_code} {reason}".rstrip()
        else:
            text = f"upgrade refused with HTTP {http_status} {reason}".rstrip()
        if error is not None:
            text = f"{text} ({error})"
        super().__init__(text)


class GaveUp(ConvergerError):
    """Reconnecting failed as many times in a row as the :class:`~converger.Backoff` allows."""

    def __init__(self, attempts: int, last_error: BaseException | None) -> None:
        self.attempts = attempts
        self.last_error = last_error
        super().__init__(f"gave up after {attempts} failed connection attempts: {last_error}")


class AckTimeout(ConvergerError):
    """No ack (or refusal) arrived within the timeout; the frame is no longer resent.

    It may still have been committed: a resend with the same clientId answers a duplicate ack.
    """

    def __init__(self, client_id: str, timeout: float) -> None:
        self.client_id = client_id
        self.timeout = timeout
        super().__init__(f"no ack for {client_id} within {timeout:g} s")


class ClientClosed(ConvergerError):
    """The client was closed (or stopped for good) while this operation waited."""


class FrameTooLarge(ConvergerError):
    """The frame is larger than the connection's ``maxFrameBytes``; it was not sent."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"frame of {size} bytes is above maxFrameBytes ({limit})")


class StreamInterrupted(ConvergerError):
    """A chunk could not be sent: the connection is down, or it dropped since the stream opened.

    When an agent's connection ends, the server aborts its open streams (end users get
    ``streamEnd`` with status ``aborted`` and reason ``disconnected``), so the stream cannot
    continue, not even after the reconnect. The turn can still be answered:
    :meth:`~converger.AnswerStream.finish` and :meth:`~converger.Turn.reply` resend the answer
    until it is acknowledged, over the next connection. ``stream_id`` and ``conversation_id``
    name the stream.
    """

    def __init__(self, conversation_id: str, stream_id: str, why: str) -> None:
        self.conversation_id = conversation_id
        self.stream_id = stream_id
        super().__init__(f"stream {stream_id} interrupted: {why}")


class RestError(ConvergerError):
    """A REST call answered with an error status and ``{"error": {"code", "message"}}``.

    ``status`` is the HTTP status, ``code`` and ``message`` come from the body (``code`` is
    ``"http_<status>"`` when the body has none), ``retry_after`` is the ``Retry-After`` header
    in seconds, when given.
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        retry_after: float | None = None,
        body: Any = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.body = body
        super().__init__(f"HTTP {status} {code}: {message}".rstrip(": "))


class InvalidRequestError(RestError):
    """400 ``bad_request`` / ``invalid_message``, 413 ``payload_too_large``, 405, 426."""


class AuthenticationError(RestError):
    """401: a missing or wrong credential (``unauthorized``, ``token_expired``)."""


class PermissionDeniedError(RestError):
    """403: ``forbidden`` or ``channel_inactive``."""


class NotFoundError(RestError):
    """404: ``not_found`` or ``conversation_not_found`` (foreign resources look missing)."""


class ConflictError(RestError):
    """409: ``conversation_closed``."""


class InternalServerError(RestError):
    """500 ``internal``: a database failure; retrying may help."""


class ServiceUnavailableError(RestError):
    """503 ``unavailable``: a database timeout or a draining node; see ``retry_after``."""


def rest_error_class(status: int) -> type[RestError]:
    """The :class:`RestError` subclass for an HTTP status."""
    if status == 401:
        return AuthenticationError
    if status == 403:
        return PermissionDeniedError
    if status == 404:
        return NotFoundError
    if status == 409:
        return ConflictError
    if status == 503:
        return ServiceUnavailableError
    if status >= 500:
        return InternalServerError
    return InvalidRequestError
