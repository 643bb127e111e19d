"""Network faults through a proxy: lost acks, lost leases, missed turns, end-user reconnects."""

from __future__ import annotations

import asyncio

import pytest
from support import FAST, WAIT, Env, Proxy, Recorder, first_of, next_message, turn_of

from converger import Agent, Conversation, ErrorEvent, LeaseLost, Message, Turn


def echo_agent(url: str, token: str, acked: Recorder, **options: object) -> Agent:
    agent = Agent(url, token, group="bot", backoff=FAST, **options)  # type: ignore[arg-type]

    @agent.turn
    async def echo(turn: Turn) -> None:
        await turn.reply(f"#{turn.seq} echo: {turn.text}")
        acked.append(turn.seq)

    return agent


async def test_a_reply_whose_ack_was_lost_is_resent_and_committed_once(
    env: Env, proxy: Proxy
) -> None:
    agent = Agent(proxy.url, await env.agent_token(), group="bot", backoff=FAST)
    await agent.connect()
    await agent.wait_eligible()
    conversation_id, user_token = await env.conversation()
    async with agent, Conversation(env.url, user_token, backoff=FAST) as user:
        await user.send_text("hello")
        turn = await anext(agent.turns())
        proxy.drop_downstream = True  # the node's answers no longer reach the agent
        reply = asyncio.create_task(turn.reply(f"#{turn.seq} once"))
        answer = await next_message(user, lambda m: m.from_ == "bot")  # committed
        assert not reply.done() and agent.unacked == [turn.client_id]
        proxy.drop_downstream = False
        proxy.cut()  # the connection dies before the ack was read
        ack = await asyncio.wait_for(reply, WAIT)
        assert ack.duplicate and ack.seqs == [answer.seq]
        assert agent.connections == 2 and agent.unacked == []
    assert [a.text for a in await env.answers(conversation_id)] == ["#1 once"]


async def test_a_stale_fence_surfaces_as_lease_lost(env: Env, proxy: Proxy) -> None:
    token = await env.agent_token()
    first_holder = Agent(proxy.url, token, group="bot", lease=True, backoff=FAST)
    welcome = await first_holder.connect()
    assert welcome.claim == "lease" and welcome.lease_ms
    await first_holder.wait_eligible()
    conversation_id, user_token = await env.conversation()
    await env.rest.post_activity(user_token, conversation_id, "charge 10")
    first = await anext(first_holder.turns())
    assert first.fence == 1

    # A second member joins; then the first one's network path dies mid-turn: its lease is
    # released when its socket closes and the takeover claims the turn for the second.
    second_holder = Agent(env.url, token, group="bot", lease=True, backoff=FAST)
    await second_holder.connect()
    proxy.accepting = False
    proxy.cut()
    taken = await asyncio.wait_for(anext(second_holder.turns()), WAIT)
    assert (taken.key, taken.fence) == (first.key, 2)
    await taken.reply(f"#{taken.seq} by the second holder")

    proxy.accepting = True  # the first holder comes back and answers with its old fence
    with pytest.raises(LeaseLost) as lost:
        await first.reply(f"#{first.seq} by the first holder", timeout=WAIT)
    assert lost.value.current_fence == 2 and not lost.value.retryable
    assert first_holder.connections >= 2
    await first_holder.close()
    await second_holder.close()
    texts = [a.text for a in await env.answers(conversation_id)]
    assert texts == ["#1 by the second holder"]


async def test_turns_sent_while_an_agent_was_away_are_answered_after_it_reconnects(
    env: Env, proxy: Proxy
) -> None:
    acked = Recorder()
    agent = echo_agent(proxy.url, await env.agent_token(), acked)
    await agent.connect()
    await agent.wait_eligible()
    runner = asyncio.create_task(agent.run())
    conversation_id, user_token = await env.conversation()
    first = await env.rest.post_activity(user_token, conversation_id, "before")
    await acked.wait_for(1)
    assert agent.watermarks == {conversation_id: first.seq}  # what the next hello names

    proxy.accepting = False
    proxy.cut()
    missed = [
        (await env.rest.post_activity(user_token, conversation_id, f"while away {n}")).seq
        for n in range(3)
    ]
    proxy.accepting = True
    await acked.wait_for(4)
    agent.stop()
    await runner
    assert agent.connections >= 2
    answers = await env.answers(conversation_id)
    assert sorted(turn_of(a) for a in answers) == [first.seq, *missed], "each turn answered once"


async def test_an_end_user_sees_every_frame_exactly_once_across_a_reconnect(
    env: Env, proxy: Proxy
) -> None:
    acked = Recorder()
    token = await env.agent_token()
    agent = echo_agent(env.url, token, acked)
    await agent.connect()
    await agent.wait_eligible()
    runner = asyncio.create_task(agent.run())
    conversation_id, user_token = await env.conversation("alice")
    user = Conversation(proxy.url, user_token, backoff=FAST)
    await user.connect()
    seen = Recorder()

    async def read_all() -> None:
        async for message in user.messages():
            seen.append(message)

    reader = asyncio.create_task(read_all())
    one = await user.send_text("one")
    await seen.wait_for(1)  # the echo of "one"

    # "two" is stored but its ack is lost with the connection
    proxy.drop_downstream = True
    sending = asyncio.create_task(user.send_text("two", client_id="c-two"))
    await acked.wait_for(2)  # the agent answered "two": it is committed
    proxy.drop_downstream = False
    proxy.accepting = False
    proxy.cut()
    # meanwhile: a proactive agent frame, and a turn of the same user from elsewhere (REST)
    await agent.send(conversation_id, "#0 a note", client_id="note-1")
    await env.rest.post_activity(user_token, conversation_id, "three", idempotency_key="t-3")
    await acked.wait_for(3)
    sent_offline = asyncio.create_task(user.send_text("four"))  # queued until reconnected
    proxy.accepting = True

    two = await asyncio.wait_for(sending, WAIT)
    four = await asyncio.wait_for(sent_offline, WAIT)
    assert two.duplicate and two.client_id == "c-two"
    await acked.wait_for(4)
    # a last round trip: anything repeated would have arrived before its answer
    five = await user.send_text("five")
    echo = f"#{five.seq} echo: five"
    await seen.wait_until(lambda items: any(m.text == echo for m in items), "the last echo")
    own = {one.seq, two.seq, four.seq, five.seq}
    expected = [frame.seq for frame in await env.frames(conversation_id) if frame.seq not in own]
    messages: list[Message] = seen.items
    seqs = [message.seq for message in messages]
    assert sorted(seqs) == expected, "every frame once"
    assert len(seqs) == len(set(seqs))
    from_elsewhere = [m for m in messages if m.client_id == "t-3"]
    assert [m.text for m in from_elsewhere] == ["three"]
    assert [m.text for m in messages if m.text and "note" in m.text] == ["#0 a note"]
    assert five.seq is not None and user.watermark == five.seq + 1
    await user.close()
    await reader
    agent.stop()
    await runner
    texts = [frame.text for frame in await env.frames(conversation_id)]
    assert texts.count("two") == 1 and texts.count("four") == 1


@pytest.mark.node_env({"CONVERGER_LIMITS__MAX_FRAMES_PER_SEC": "4"})
async def test_sends_refused_as_rate_limited_are_resent_until_acked(env: Env) -> None:
    conversation_id, user_token = await env.conversation()
    async with Conversation(env.url, user_token, backoff=FAST) as user:
        events = user.events()
        acks = await asyncio.wait_for(
            asyncio.gather(*(user.send_text(f"burst {n}", client_id=f"b-{n}") for n in range(8))),
            WAIT * 2,
        )
        refused = await first_of(events, lambda e: isinstance(e, ErrorEvent))
        assert refused.error.code == "rate_limited" and refused.error.retryable
    assert sorted(ack.seq or 0 for ack in acks) == list(range(1, 9))
    texts = [frame.text or "" for frame in await env.frames(conversation_id)]
    assert sorted(texts) == sorted(f"burst {n}" for n in range(8)), "each send stored once"
