"""Pieces without a server: backoff, trackers, parsing, the ownership hash of the tests."""

from __future__ import annotations

import asyncio

import pytest
from support import owner_hash

from converger import (
    Backoff,
    FatalClose,
    LeaseLost,
    ServerError,
    StaleRuntime,
    TurnConflict,
    TurnSuperseded,
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
