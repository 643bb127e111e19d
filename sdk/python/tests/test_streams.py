"""Streamed answers against a real node: the agent's AnswerStream, the end user's assembly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support import FAST, WAIT, Env, Proxy, eventually, first_of, next_message

from converger import (
    Agent,
    Conversation,
    LeaseLost,
    StreamInterrupted,
    StreamUpdate,
    Turn,
)


async def started_agent(url: str, env: Env, **options: Any) -> Agent:
    """A connected member whose `since` has passed (turns sent from now on reach it)."""
    agent = Agent(url, await env.agent_token(), group="bot", backoff=FAST, **options)
    await agent.connect()
    await agent.wait_eligible()
    return agent


async def a_turn(agent: Agent, user: Conversation, text: str = "hi") -> Turn:
    await user.send_text(text)
    return await asyncio.wait_for(anext(agent.turns()), WAIT)


def is_chunk(index: int) -> Any:
    return lambda update: update.chunk is not None and update.chunk.index == index


def is_end(update: StreamUpdate) -> bool:
    return update.end is not None


async def test_a_streamed_answer_is_assembled_and_committed_under_the_streams_id(
    env: Env,
) -> None:
    agent = await started_agent(env.url, env)
    conversation_id, user_token = await env.conversation()
    async with agent, Conversation(env.url, user_token, backoff=FAST) as user:
        assert agent.welcome.streams and user.welcome.streams
        assert agent.welcome.limits.max_stream_bytes == 262144
        assert agent.welcome.limits.max_streams_per_connection == 64
        updates: AsyncIterator[StreamUpdate] = user.stream_updates()
        turn = await a_turn(agent, user)
        card = {"type": "card", "title": "a card"}
        async with turn.stream() as stream:
            await stream.text("Hel")
            await stream.text("")  # sends nothing
            await stream.text("lo")
            await stream.chunk(card)
            # the end user sees every chunk while the answer is still being written
            seen = [await first_of(updates, lambda _: True) for _ in range(3)]
            assert [u.chunk.index for u in seen if u.chunk] == [0, 1, 2]
            assert seen[0].chunk is not None and seen[0].chunk.turn is not None
            assert seen[0].chunk.turn.seq == turn.seq
            assert seen[0].chunk.sender is not None and seen[0].chunk.sender.id == "bot"
            assert [u.chunk.text for u in seen if u.chunk] == ["Hel", "lo", None]
            assert seen[2].chunk is not None and seen[2].chunk.chunk == card
            assert user.streams.open == [seen[0].stream]
        # leaving the block committed the streamed text, stored under the stream's id
        assert stream.state == "finished" and stream.ack is not None
        answer = await next_message(user, lambda m: m.from_ == "bot")
        assert (answer.id, answer.text) == (stream.stream_id, "Hello")
        assert answer.raw["streamId"] == stream.stream_id
        assert stream.ack.seqs == [answer.seq] and turn.ack is stream.ack
        end = await first_of(updates, is_end)
        assert end.stream_id == stream.stream_id and end.end is not None and end.end.committed
        assembled = user.streams.get(stream.stream_id)
        assert assembled is not None and assembled.committed
        assert (assembled.text, assembled.chunks, assembled.next_index) == ("Hello", [card], 3)
        assert assembled.duplicates == 0 and user.streams.open == []
        with pytest.raises(RuntimeError):
            await stream.text("late")
    stored = await env.answers(conversation_id)
    assert [(m.id, m.text) for m in stored] == [(stream.stream_id, "Hello")]


async def test_an_exception_in_the_block_aborts_the_stream_and_a_new_stream_answers(
    env: Env,
) -> None:
    agent = await started_agent(env.url, env)
    conversation_id, user_token = await env.conversation()
    async with agent, Conversation(env.url, user_token, backoff=FAST) as user:
        updates = user.stream_updates()
        turn = await a_turn(agent, user)
        with pytest.raises(ZeroDivisionError):
            async with turn.stream() as failed:
                await failed.text("about to fail")
                await first_of(updates, is_chunk(0))
                _ = 1 / 0
        aborted = await first_of(updates, is_end)
        assert aborted.stream_id == failed.stream_id and aborted.end is not None
        assert (aborted.end.status, aborted.end.reason) == ("aborted", "error")
        assert failed.state == "aborted"

        # the turn is still pending: a new stream (a new default id) answers it
        stream = turn.stream()
        assert stream.stream_id != failed.stream_id
        assert stream.stream_id.startswith(f"stream-{turn.seq}-{turn.revision}-")
        await stream.text("second ")
        await stream.text("try")
        ack = await stream.finish(runtime={"streams": 2})
        answer = await next_message(user, lambda m: m.from_ == "bot")
        assert (answer.id, answer.text, answer.seq) == (stream.stream_id, "second try", ack.seqs[0])
        committed = await first_of(updates, is_end)
        assert committed.stream_id == stream.stream_id and committed.stream.committed
        assert committed.stream.text == "second try"
    assert [m.text for m in await env.answers(conversation_id)] == ["second try"]


async def test_an_end_user_who_reconnects_mid_stream_ends_with_exactly_the_streamed_text(
    env: Env, proxy: Proxy
) -> None:
    agent = await started_agent(env.url, env)
    _, user_token = await env.conversation()
    user = Conversation(proxy.url, user_token, backoff=FAST)
    await user.connect()
    applied: list[StreamUpdate] = []
    try:
        updates = user.stream_updates()

        async def next_update(predicate: Any) -> StreamUpdate:
            update: StreamUpdate = await first_of(updates, lambda _: True)
            applied.append(update)
            assert predicate(update), update
            return update

        turn = await a_turn(agent, user)
        stream = turn.stream("s-reconnect")
        await stream.text("one ")
        await stream.text("two ")
        await next_update(is_chunk(0))
        await next_update(is_chunk(1))

        proxy.accepting = False
        proxy.cut()  # the end user's connection dies mid-stream
        await eventually("the end user notices", lambda: not user.connected)
        await stream.text("three ")  # written while the end user is away
        proxy.accepting = True
        await user.wait_connected(WAIT, connections=2)
        # the new connection is shown the open stream from index 0: only index 2 is new
        await next_update(is_chunk(2))
        await stream.text("four")
        await next_update(is_chunk(3))
        await stream.finish()
        answer = await next_message(user, lambda m: m.from_ == "bot")
        await next_update(is_end)

        assembled = user.streams.get("s-reconnect")
        assert assembled is not None and assembled.committed
        assert assembled.text == "one two three four" == answer.text
        assert answer.id == "s-reconnect"
        assert [u.chunk.index for u in applied if u.chunk] == [0, 1, 2, 3]
        # Chunks 0 and 1 came again, coalesced, and were dropped: counted as 2 when the node took
        # chunk 2 (written on another socket) before the catch-up, which then covered 0 to 2,
        # else as 1 (the catch-up covered 0 and 1, and chunk 2 came live).
        assert assembled.duplicates in (1, 2)
    finally:
        await user.close()
        await agent.close()


async def test_an_agent_that_disconnects_mid_stream_aborts_it_and_answers_after_reconnecting(
    env: Env, proxy: Proxy
) -> None:
    agent = await started_agent(proxy.url, env)
    conversation_id, user_token = await env.conversation()
    async with Conversation(env.url, user_token, backoff=FAST) as user:
        updates = user.stream_updates()
        turn = await a_turn(agent, user)
        stream = turn.stream()
        await stream.text("Hel")
        await first_of(updates, is_chunk(0))

        proxy.accepting = False
        proxy.cut()  # the agent's connection dies mid-stream
        ended = await first_of(updates, is_end)
        assert ended.stream_id == stream.stream_id and ended.end is not None
        assert (ended.end.status, ended.end.reason) == ("aborted", "disconnected")
        await eventually("the agent notices", lambda: not agent.connected)
        with pytest.raises(StreamInterrupted) as down:
            await stream.text("lo")
        assert down.value.stream_id == stream.stream_id
        proxy.accepting = True
        await agent.wait_connected(WAIT, connections=2)
        with pytest.raises(StreamInterrupted):
            await stream.text("lo")  # a new connection does not continue the old stream
        assert stream.streamed_text == "Hel"

        ack = await turn.reply("Hello")  # the turn can still be answered
        answer = await next_message(user, lambda m: m.from_ == "bot")
        assert answer.text == "Hello" and ack.seqs == [answer.seq]
        await stream.abort()  # nothing to send: the server aborted it already
        assert stream.state == "aborted"
        await agent.close()
    assert [m.text for m in await env.answers(conversation_id)] == ["Hello"]


async def test_a_chunk_or_finish_after_the_lease_moved_raises_lease_lost(env: Env) -> None:
    agent = await started_agent(env.url, env, lease=True)
    conversation_id, user_token = await env.conversation()
    async with agent, Conversation(env.url, user_token, backoff=FAST) as user:
        updates = user.stream_updates()
        turn = await a_turn(agent, user)
        assert turn.fence == 1
        stream = turn.stream()
        await stream.text("Hel")  # index 0 carries turn.fence 1
        await first_of(updates, is_chunk(0))

        # another worker claims the turn: the fence moves on
        env.sql(
            "UPDATE turns SET fence = fence + 1, claimed_by = 'another-worker' "
            f"WHERE conversation_id = '{conversation_id}' AND seq = {turn.seq} "
            f"AND revision = {turn.revision}"
        )

        # a stream opened now is refused at its first chunk; the next chunk raises it
        late = turn.stream()
        await late.text("too late")
        await eventually("the refusal of the late stream", lambda: late.refusal is not None)
        with pytest.raises(LeaseLost) as refused:
            await late.text("again")
        assert refused.value.current_fence == 2
        assert (refused.value.stream_id, refused.value.frame_type) == (
            late.stream_id,
            "streamChunk",
        )

        # the open stream's answer is refused by the registry, and its viewers see it end
        with pytest.raises(LeaseLost) as lost:
            await stream.finish()
        assert lost.value.current_fence == 2
        ended = await first_of(updates, is_end)
        assert ended.stream_id == stream.stream_id and ended.end is not None
        assert (ended.end.status, ended.end.reason) == ("aborted", "lease_lost")
        await late.abort()
    assert await env.answers(conversation_id) == []
