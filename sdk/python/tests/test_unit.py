"""Pieces without a server: backoff, trackers, parsing, the ownership hash of the tests."""

from __future__ import annotations

import asyncio

import pytest
from support import owner_hash

from converger import (
    Agent,
    Backoff,
    FatalClose,
    LeaseLost,
    Message,
    Runtime,
    ServerError,
    StaleRuntime,
    StreamAssembly,
    StreamChunk,
    StreamClosed,
    StreamEnd,
    TooManyStreams,
    Turn,
    TurnConflict,
    TurnSuperseded,
    Welcome,
    is_valid_client_id,
    result_client_id,
    ws_url,
)
from converger._connection import Retry, open_session, retry_hint_of_reason
from converger._tracking import ChannelTracker, SeqTracker
from converger.frames import Abort, ConversationMessage, Resume, UserTyping, parse_agent_event


def test_full_jitter_stays_under_the_ceiling_and_honours_the_hint() -> None:
    backoff = Backoff(initial=0.5, maximum=30.0)
    assert [backoff.ceiling(n) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff.ceiling(500) == 30.0
    assert backoff.delay(3, rand=lambda: 0.0) == 0.0
    assert backoff.delay(3, rand=lambda: 1.0) == 4.0
    assert backoff.delay(3, rand=lambda: 0.25) == 1.0
    # The server's retryAfterMs is a floor, bounded so a bad hint cannot park the client.
    assert backoff.delay(0, retry_after=2.0, rand=lambda: 0.5) == 2.0
    assert backoff.delay(0, retry_after=10_000.0, rand=lambda: 0.5) == 300.0
    assert not Backoff(max_attempts=None).exhausted(10**6)
    assert Backoff(max_attempts=3).exhausted(3)


def test_close_reasons_carry_retry_hints() -> None:
    assert retry_hint_of_reason('{"reason":"unavailable","retryAfterMs":2500}') == 2.5
    assert retry_hint_of_reason('{"reason":"slow_consumer","retryAfterMs":50}') == 0.05
    assert retry_hint_of_reason("idle") is None
    assert retry_hint_of_reason("{not json") is None


def test_ws_url_accepts_a_base_url() -> None:
    assert ws_url("http://127.0.0.1:8080") == "ws://127.0.0.1:8080/socket/converger/v1"
    assert ws_url("https://gw.example") == "wss://gw.example/socket/converger/v1"
    assert ws_url("ws://h:1/socket/converger/v1") == "ws://h:1/socket/converger/v1"


def test_seq_tracker_yields_each_seq_once_and_holds_the_watermark_below_a_gap() -> None:
    seen = SeqTracker(0)
    assert seen.observe(1) and seen.observe(2) and not seen.observe(2)
    assert seen.watermark == 2
    assert seen.observe(5) and seen.has_gap and seen.watermark == 2
    assert seen.observe(3) and seen.observe(4)
    assert seen.watermark == 5 and not seen.has_gap
    assert not seen.observe(4)


def test_channel_tracker_dedupes_turn_deliveries_and_orders_watermarks() -> None:
    tracker = ChannelTracker({"a": 3})
    assert tracker.first_delivery("a", 5, 0, None)
    assert not tracker.first_delivery("a", 5, 0, None)  # a replay
    assert tracker.first_delivery("a", 5, 1, None)  # an edit: a new revision
    assert not tracker.first_delivery("a", 5, 0, None)  # an older revision
    assert tracker.first_delivery("b", 2, 0, 1)
    assert not tracker.first_delivery("b", 2, 0, 1)
    assert tracker.first_delivery("b", 2, 0, 2)  # lease mode: a newer claim
    tracker.observe_seq("b", 9)
    tracker.observe_seq("a", 7)
    assert tracker.watermarks() == {"a": 7, "b": 9}
    assert list(tracker.watermarks(limit=1)) == ["a"]  # the most recently active first
    tracker.forget_delivery("a", 5, 1)
    assert tracker.first_delivery("a", 5, 1, None)


def test_refusals_map_to_typed_errors() -> None:
    lost = ServerError.from_data(
        {
            "code": "lease_lost",
            "message": "the turn was claimed again since this delivery",
            "number": 4103,
            "retryable": False,
            "clientId": "r-1",
            "frameType": "turnResult",
            "details": {"fence": 3},
        }
    )
    assert isinstance(lost, LeaseLost) and lost.current_fence == 3
    assert (lost.client_id, lost.frame_type, lost.number) == ("r-1", "turnResult", 4103)
    stale = ServerError.from_data({"code": "stale_runtime", "details": {"version": 4}})
    assert isinstance(stale, StaleRuntime) and stale.current_version == 4
    superseded = ServerError.from_data({"code": "turn_superseded", "details": {"revision": 2}})
    assert isinstance(superseded, TurnSuperseded) and superseded.latest_revision == 2
    conflict = ServerError.from_data({"code": "turn_conflict", "details": {"seqs": [4, 5]}})
    assert isinstance(conflict, TurnConflict) and conflict.committed_seqs == [4, 5]
    other = ServerError.from_data({"code": "internal", "retryable": True, "retryAfterMs": 100})
    assert type(other) is ServerError and other.retryable and other.retry_after_ms == 100


def test_result_client_ids_follow_the_rust_client() -> None:
    conversation = "0193e0a4-0000-7000-8000-000000000001"
    assert (
        result_client_id(conversation, 18, 1, None)
        == "result-0193e0a4000070008000000000000001-18-1"
    )
    assert result_client_id(conversation, 18, 1, 2).endswith("-18-1-f2")


def test_agent_events_are_typed() -> None:
    resume = parse_agent_event("c", {"type": "resume", "clientId": "r", "data": {"a": 1}})
    assert isinstance(resume, Resume) and resume.client_id == "r" and resume.data == {"a": 1}
    assert isinstance(parse_agent_event("c", {"type": "abort", "data": {}}), Abort)
    typing = parse_agent_event(
        "c", {"type": "typing", "isTyping": True, "sender": {"id": "alice", "role": "user"}}
    )
    assert isinstance(typing, UserTyping) and typing.is_typing
    plain = parse_agent_event(
        "c", {"type": "text", "id": "x", "seq": 4, "from": "bot", "data": {"text": "hi"}}
    )
    assert isinstance(plain, ConversationMessage) and plain.message.text == "hi"


@pytest.mark.parametrize(
    ("conversation", "connection", "expected"),
    [
        ("conv-1", "conn-a", 0x7359AB5AF7DEAE7C),
        ("conv-1", "conn-b", 0xBD7537DB2F810133),
        (
            "01a22950-e27c-70ee-8573-bb2efb3893ae",
            "7766ad75-64f7-404e-9ed5-16a5dd98a336",
            0x445F1DDA713C3F46,
        ),
    ],
)
def test_the_test_suites_owner_hash_matches_adr_0006(
    conversation: str, connection: str, expected: int
) -> None:
    assert owner_hash(conversation, connection) == expected


async def refusing_http_server(status_line: str, headers: str) -> asyncio.Server:
    """A bare HTTP responder that refuses every upgrade with one status (a stand-in: a real
    draining node refuses upgrades with 503 only for the moments before it exits)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(f"HTTP/1.1 {status_line}\r\n{headers}Content-Length: 0\r\n\r\n".encode())
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


async def test_an_http_503_upgrade_refusal_is_retried_after_its_retry_after() -> None:
    server = await refusing_http_server("503 Service Unavailable", "Retry-After: 2\r\n")
    port = server.sockets[0].getsockname()[1]
    with pytest.raises(Retry) as refused:
        await open_session(f"ws://127.0.0.1:{port}/socket/converger/v1", {}, 5)
    assert refused.value.retry_after == 2.0
    server.close()
    fatal_server = await refusing_http_server("400 Bad Request", "")
    port = fatal_server.sockets[0].getsockname()[1]
    with pytest.raises(FatalClose) as fatal:
        await open_session(f"ws://127.0.0.1:{port}/socket/converger/v1", {}, 5)
    assert fatal.value.http_status == 400 and fatal.value.close_code is None
    fatal_server.close()


def chunk(
    index: int, text: str | None = None, stream_id: str = "s-1", **extra: object
) -> StreamChunk:
    frame: dict[str, object] = {
        "type": "streamChunk",
        "streamId": stream_id,
        "index": index,
        "turn": {"seq": 7, "revision": 0},
        "from": {"id": "bot", "role": "agent"},
        **extra,
    }
    if text is not None:
        frame["text"] = text
    parsed = StreamChunk.parse(frame)
    assert parsed is not None
    return parsed


def test_stream_frames_are_parsed() -> None:
    first = chunk(0, "Hel")
    assert (first.stream_id, first.index, first.text, first.chunk) == ("s-1", 0, "Hel", None)
    assert first.turn is not None and (first.turn.seq, first.turn.revision) == (7, 0)
    assert first.sender is not None and first.sender.role == "agent"
    card = chunk(1, chunk={"type": "card"})
    assert card.text is None and card.chunk == {"type": "card"}
    assert StreamChunk.parse({"type": "streamChunk", "streamId": "s"}) is None
    end = StreamEnd.parse(
        {"type": "streamEnd", "streamId": "s", "status": "aborted", "reason": "x"}
    )
    assert end is not None and not end.committed and end.reason == "x"
    assert StreamEnd.parse({"type": "streamEnd", "streamId": "s", "status": "later"}) is None
    welcome = Welcome.parse(
        {
            "capabilities": {"streams": True},
            "limits": {"maxStreamBytes": 9, "maxStreamsPerConnection": 2},
        }
    )
    assert welcome.streams and welcome.limits.max_stream_bytes == 9
    assert welcome.limits.max_streams_per_connection == 2
    assert not Welcome.parse({}).streams and Welcome.parse({}).limits.max_stream_bytes is None
    # transient stream frames are never persistent messages, even with a seq
    assert Message.parse({"type": "streamChunk", "seq": 3, "streamId": "s", "index": 0}) is None


def test_the_assembly_applies_each_chunk_once_in_order() -> None:
    assembly = StreamAssembly()
    assert assembly.apply_chunk(chunk(1, "lo")) is None  # nothing before index 0: a gap
    stream = assembly.apply_chunk(chunk(0, "Hel"))
    assert stream is not None and stream.text == "Hel" and stream.turn is not None
    assert assembly.apply_chunk(chunk(0, "Hel")) is None  # a repeat
    assert assembly.apply_chunk(chunk(2, "!")) is None  # a gap
    assert assembly.apply_chunk(chunk(1, "lo")) is stream
    assert assembly.apply_chunk(chunk(2, chunk={"type": "card"})) is stream
    # a reconnect shows the open stream from index 0 again: nothing doubles
    for index, text in enumerate(["Hel", "lo"]):
        assert assembly.apply_chunk(chunk(index, text)) is None
    assert (stream.text, stream.chunks, stream.next_index) == ("Hello", [{"type": "card"}], 3)
    assert stream.duplicates == 3 and assembly.open == [stream] and "s-1" in assembly
    end = StreamEnd("s-1", "committed", None, {})
    assert assembly.apply_end(end) is stream and stream.committed
    assert assembly.apply_end(StreamEnd("s-1", "aborted", "late", {})) is None  # first end wins
    assert stream.status == "committed" and stream.reason is None
    assert assembly.apply_chunk(chunk(3, "late")) is None
    assert stream.text == "Hello" and assembly.open == []


def test_a_coalesced_chunk_adds_only_what_was_not_applied() -> None:
    assembly = StreamAssembly()
    assert assembly.apply_chunk(chunk(0, "w0 ")) is not None
    stream = assembly.apply_chunk(chunk(1, "w1 "))
    assert stream is not None
    # a reconnect catches up with the whole run so far: only "w2 w3 " is new
    assert assembly.apply_chunk(chunk(3, "w0 w1 w2 w3 ", firstIndex=0)) is stream
    assert (stream.text, stream.next_index, stream.duplicates) == ("w0 w1 w2 w3 ", 4, 2)
    assert assembly.apply_chunk(chunk(3, "w0 w1 w2 w3 ", firstIndex=0)) is None
    assert assembly.apply_chunk(chunk(6, "w5 w6 ", firstIndex=5)) is None  # a gap
    assert assembly.apply_chunk(chunk(4, "w4")) is stream
    fresh = StreamAssembly()
    caught_up = fresh.apply_chunk(chunk(3, "w0 w1 w2 w3 ", firstIndex=0))
    assert caught_up is not None and caught_up.text == "w0 w1 w2 w3 "
    bad = {"type": "streamChunk", "streamId": "s", "index": 1, "firstIndex": 2}
    assert StreamChunk.parse(bad) is None


def test_the_assembly_ends_a_stream_on_its_stored_answer_and_forgets_old_ended_ones() -> None:
    assembly = StreamAssembly(max_ended=2)
    assert assembly.apply_chunk(chunk(0, "a", stream_id="s-a")) is not None
    answer = Message.parse(
        {"type": "text", "id": "s-a", "seq": 4, "streamId": "s-a", "data": {"text": "a"}}
    )
    assert answer is not None
    ended = assembly.apply_message(answer)
    assert ended is not None and ended.committed and ended.stream_id == "s-a"
    assert assembly.apply_message(answer) is None  # once
    assert assembly.apply_end(StreamEnd("s-a", "committed", None, {})) is None
    # an end for a stream none of which arrived shows nothing, and keeps its late chunks out
    assert assembly.apply_end(StreamEnd("s-b", "aborted", "node_down", {})) is None
    assert assembly.apply_chunk(chunk(0, "b", stream_id="s-b")) is None
    ended_b = assembly.get("s-b")
    assert ended_b is not None and (ended_b.status, ended_b.reason) == ("aborted", "node_down")
    assert assembly.apply_end(StreamEnd("s-c", "aborted", None, {})) is None
    assert [stream.stream_id for stream in assembly] == ["s-b", "s-c"]  # s-a was the oldest
    assert len(assembly) == 2


def test_stream_refusals_map_to_typed_errors() -> None:
    details = {"streamId": "s-1", "index": 4}
    closed = ServerError.from_data(
        {"code": "stream_closed", "frameType": "streamChunk", "details": details}
    )
    assert isinstance(closed, StreamClosed) and (closed.stream_id, closed.index) == ("s-1", 4)
    assert isinstance(ServerError.from_data({"code": "too_many_streams"}), TooManyStreams)
    lost = ServerError.from_data({"code": "lease_lost", "details": {"streamId": "s", "fence": 3}})
    assert isinstance(lost, LeaseLost) and lost.current_fence == 3 and lost.index is None


def a_turn(agent: Agent) -> Turn:
    return Turn(
        conversation_id="0193e0a4-0000-7000-8000-000000000001",
        seq=18,
        revision=2,
        key="0193e0a4-0000-7000-8000-000000000001:18:2",
        reason="edit",
        runtime=Runtime(),
        delivered_runtime=Runtime(),
        frame={},
        meta={},
        fence=None,
        participant=None,
        channel_id=None,
        message=None,
        _agent=agent,
    )


async def test_default_stream_ids_are_unique_and_have_the_client_id_shape() -> None:
    agent = Agent("ws://127.0.0.1:9", "token", group="bot")
    turn = a_turn(agent)
    first, second = turn.stream(), turn.stream()
    assert first.stream_id != second.stream_id
    for stream in (first, second):
        assert stream.stream_id.startswith("stream-18-2-") and is_valid_client_id(stream.stream_id)
        assert stream.state == "open" and stream.chunks_sent == 0
    assert turn.stream("mine").stream_id == "mine"
    with pytest.raises(ValueError, match="invalid streamId"):
        turn.stream("no spaces")
    keep = turn.stream("twice")
    with pytest.raises(ValueError, match="already open"):
        turn.stream("twice")
    await keep.abort()  # never opened: nothing to send
    assert keep.state == "aborted"
    with pytest.raises(RuntimeError):
        await keep.text("after the end")
    with pytest.raises(ValueError, match="streamed no text"):
        await first.finish()
