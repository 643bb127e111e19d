"""The agent API against a real node: typed turns, replies, refusals, events, fatal closes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support import FAST, WAIT, Env, collect, eventually, next_message, turn_of

from converger import (
    Abort,
    Agent,
    AgentEvent,
    Conversation,
    FatalClose,
    PresenceChange,
    ReadReceipt,
    Resume,
    RunStatus,
    Runtime,
    StaleRuntime,
    Turn,
    TurnConflict,
    TurnInProgress,
    TurnStopped,
    TurnSuperseded,
    Typing,
    UserTyping,
)


async def started_agent(env: Env, **options: Any) -> Agent:
    """A connected member whose `since` has passed (turns sent from now on reach it)."""
    agent = Agent(env.url, await env.agent_token(), backoff=FAST, **options)
    await agent.connect()
    await agent.wait_eligible()
    return agent


async def test_turns_are_typed_and_the_runtime_travels_with_the_next_turn(env: Env) -> None:
    agent = await started_agent(env, group="bot")
    conversation_id, user_token = await env.conversation("alice")
    async with agent, Conversation(env.url, user_token, backoff=FAST) as user:
        turns = agent.turns()
        await user.send_text("hello")
        turn = await anext(turns)
        assert (turn.conversation_id, turn.seq, turn.revision) == (conversation_id, 1, 0)
        assert turn.key == f"{conversation_id}:1:0"
        assert turn.reason is None and turn.fence is None
        assert turn.text == "hello" and turn.type == "text"
        assert turn.runtime == Runtime(0, {})
        assert turn.participant is not None and turn.participant.id == "alice"
        assert turn.channel_id == env.channel_id
        assert turn.message is not None and turn.message.from_ == "user"

        # typing and run status reach the end user as transient events
        events = user.events()
        assert await turn.typing(True)
        assert await turn.run_status({"phase": "thinking"})
        typing, run = await collect(events, 2)
        assert isinstance(typing, Typing) and typing.is_typing and typing.sender is None
        assert isinstance(run, RunStatus) and run.data == {"phase": "thinking"}

        ack = await turn.reply(f"#{turn.seq} hi alice", runtime={"count": 1})
        assert ack.seqs == [2] and not ack.duplicate and turn.ack is ack
        answer = await next_message(user, lambda m: m.from_ == "bot")
        assert answer.seq == 2 and answer.text == "#1 hi alice"
        assert answer.sender is not None and answer.sender.id == "bot"  # the group name

        await user.send_text("again")
        second = await anext(turns)
        assert second.seq == 3 and second.runtime == Runtime(1, {"count": 1})
        await second.reply([])  # an empty answer completes the turn, storing nothing
    assert [m.seq for m in await env.answers(conversation_id)] == [2]


async def test_the_handler_style_answers_a_conversations_turns_in_order(env: Env) -> None:
    agent = await started_agent(env, group="bot")

    @agent.turn
    async def count(turn: Turn) -> None:
        total = int(turn.runtime.state.get("count", 0)) + 1
        await asyncio.sleep(0)  # let other turns pile up meanwhile
        await turn.reply(f"#{turn.seq} count {total}", runtime={"count": total})

    runner = asyncio.create_task(agent.run(concurrency=4))
    _, user_token = await env.conversation()
    async with Conversation(env.url, user_token, backoff=FAST) as user:
        for text in ("a", "b", "c"):
            await user.send_text(text)  # three turns before any answer
        answers = [await next_message(user, lambda m: m.from_ == "bot") for _ in range(3)]
    # each turn saw the runtime the previous answer wrote: no stale_runtime
    ordered = sorted(answers, key=turn_of)
    assert [(m.text or "").split(" ", 1)[1] for m in ordered] == ["count 1", "count 2", "count 3"]
    assert len({turn_of(m) for m in answers}) == 3
    agent.stop()
    await asyncio.wait_for(runner, WAIT)


async def test_a_stale_runtime_surfaces_as_stale_runtime(env: Env) -> None:
    agent = await started_agent(env, group="bot")
    conversation_id, user_token = await env.conversation()
    async with agent, Conversation(env.url, user_token, backoff=FAST) as user:
        turns = agent.turns()
        await user.send_text("one")
        await user.send_text("two")
        first, second = await anext(turns), await anext(turns)
        # both were delivered (and handed out) before any answer: both read version 0
        assert first.runtime.version == second.runtime.version == 0
        await first.reply(f"#{first.seq}", runtime={"n": 1})
        with pytest.raises(StaleRuntime) as stale:
            await second.reply(f"#{second.seq}", runtime={"n": 1})
        assert stale.value.current_version == 1 and stale.value.retryable
        # answering against the current version works
        await second.reply(f"#{second.seq}", runtime=Runtime(1, {"n": 2}))
    assert [turn_of(m) for m in await env.answers(conversation_id)] == [1, 2]


async def test_an_answer_to_an_edited_turns_old_revision_is_superseded(env: Env) -> None:
    agent = await started_agent(env, group="bot")
    conversation_id, user_token = await env.conversation()
    async with agent, Conversation(env.url, user_token, backoff=FAST) as user:
        turns = agent.turns()
        sent = await user.send_text("what is 2+2")
        original = await anext(turns)
        edited_ack = await user.edit("what is 3+3", seq=sent.seq)
        assert edited_ack.turn is not None and edited_ack.turn.revision == 1
        edited = await anext(turns)
        assert (edited.seq, edited.revision, edited.reason) == (original.seq, 1, "edit")
        assert edited.text == "what is 3+3" and edited.frame["replaces"] == original.seq
        with pytest.raises(TurnSuperseded) as superseded:
            await original.reply(f"#{original.seq} 4")
        assert superseded.value.latest_revision == 1
        ack = await edited.reply(f"#{edited.seq} 6")
        with pytest.raises(TurnConflict) as conflict:
            await edited.reply(f"#{edited.seq} six")  # another answer to a completed revision
        assert conflict.value.committed_seqs == ack.seqs
        again = await edited.reply(f"#{edited.seq} 6")  # the same answer again: a duplicate
        assert again.duplicate and again.seqs == ack.seqs

        regenerated_ack = await user.regenerate(seq=sent.seq)
        assert regenerated_ack.turn is not None and regenerated_ack.turn.revision == 2
        regenerated = await anext(turns)
        assert (regenerated.revision, regenerated.reason) == (2, "regenerate")
        await regenerated.reply(f"#{regenerated.seq} 6 again")
    texts = [m.text for m in await env.answers(conversation_id)]
    assert texts == ["#1 6", "#1 6 again"]


async def test_forwarded_frames_and_user_signals_arrive_as_typed_events(env: Env) -> None:
    agent = await started_agent(env, group="bot")
    events = agent.events()
    conversation_id, user_token = await env.conversation("alice")
    async with agent, Conversation(env.url, user_token, backoff=FAST) as user:
        seen: dict[type[AgentEvent], AgentEvent] = {}

        async def until(kind: type[AgentEvent]) -> AgentEvent:
            async with asyncio.timeout(WAIT):
                while kind not in seen:
                    event = await anext(events)
                    assert event.conversation_id == conversation_id
                    seen[type(event)] = event
            return seen[kind]

        presence = await until(PresenceChange)
        assert isinstance(presence, PresenceChange) and presence.status == "online"
        await user.typing(True)
        typing = await until(UserTyping)
        assert isinstance(typing, UserTyping) and typing.is_typing
        assert typing.sender is not None and typing.sender.id == "alice"
        await user.send_text("hi")
        await anext(agent.turns())
        assert await user.read(1)
        receipt = await until(ReadReceipt)
        assert isinstance(receipt, ReadReceipt) and receipt.up_to_seq == 1
        resume_id = await user.resume({"interruptId": "int-1", "answer": "yes"})
        resume = await until(Resume)
        assert isinstance(resume, Resume)
        assert resume.client_id == resume_id and resume.data["answer"] == "yes"
        await user.abort()
        assert isinstance(await until(Abort), Abort)


async def test_fatal_closes_are_never_reconnected(env: Env) -> None:
    with pytest.raises(FatalClose) as refused:
        await Agent(env.url, "not-a-token", group="bot").connect()
    assert refused.value.close_code == 4401
    assert refused.value.error is not None and refused.value.error.code == "unauthorized"
    with pytest.raises(FatalClose) as bad_group:
        await Agent(env.url, await env.agent_token(), group="no spaces allowed").connect()
    assert bad_group.value.close_code == 4400
    with pytest.raises(ValueError, match="group"):
        Agent(env.url, "t", lease=True)

    agent = await started_agent(env, group="bot")

    @agent.turn
    async def never(turn: Turn) -> None:
        raise AssertionError("no turn expected")

    runner = asyncio.create_task(agent.run())
    await env.rest.set_channel_status(env.api_key, env.channel_id, "inactive")
    with pytest.raises(FatalClose) as inactive:
        await asyncio.wait_for(runner, WAIT)
    assert inactive.value.close_code == 4403
    assert agent.connections == 1


async def test_a_stop_cancels_the_handler_and_the_turn_settles_with_what_was_streamed(
    env: Env,
) -> None:
    agent = await started_agent(env, group="bot")
    conversation_id, user_token = await env.conversation("alice")
    streamed: list[str] = []
    seen: list[Turn] = []
    two_words = asyncio.Event()

    @agent.turn
    async def tell_a_story(turn: Turn) -> None:
        seen.append(turn)
        async with turn.stream() as stream:
            for word in ("Once ", "upon ", "a ", "time ", "there ", "was "):
                await stream.text(word)
                streamed.append(word)
                if len(streamed) == 2:
                    two_words.set()
                await asyncio.sleep(0.2 if len(streamed) < 2 else 60)

    running = asyncio.create_task(agent.run())
    async with Conversation(env.url, user_token, backoff=FAST) as user:
        await user.send_text("tell me a story")
        await asyncio.wait_for(two_words.wait(), WAIT)
        # A chunk the agent wrote is in the stream once its node took it, and the stop ends
        # the stream after the last chunk taken: stop once the user has seen both words.
        await eventually(
            "the user sees both words",
            lambda: [s.text for s in user.streams.open] == ["Once upon "],
        )
        stopped, seq = await env.rest.stop_turn(user_token, conversation_id)
        assert (stopped, seq) == (True, 1)
        # The handler is cancelled at once; the gateway settles the turn after its grace
        # period with the text that was streamed.
        settled = await next_message(user, lambda m: m.from_ == "bot")
        assert settled.text == "Once upon "
        assert settled.data.get("status") == "stopped"
        turn = seen[0]
        assert turn.cancelled and turn.cancel_reason == "stopped"
        assert await turn.wait_cancelled() == "stopped"
        assert streamed == ["Once ", "upon "], "the handler stopped streaming"
        # A late answer is refused: the turn has its one result.
        with pytest.raises(TurnStopped):
            await turn.reply("the whole story")
    agent.stop()
    await running
    frames = await env.frames(conversation_id)
    results = [m.text for m in frames if m.sender is not None and m.sender.role != "user"]
    assert results == ["Once upon "], "one result per turn"


async def test_under_reject_a_second_send_raises_and_under_interrupt_the_first_is_cancelled(
    env: Env,
) -> None:
    agent = await started_agent(env, group="bot")
    conversation_id, user_token = await env.conversation("alice")
    channel = await env.rest.set_turn_settings(
        env.api_key, env.channel_id, turn_policy="reject", turn_policy_overrides=["interrupt"]
    )
    assert channel.turn_policy == "reject" and channel.turn_policy_overrides == ("interrupt",)
    async with agent, Conversation(env.url, user_token, backoff=FAST) as user:
        turns = agent.turns()
        await user.send_text("first")
        first = await anext(turns)
        with pytest.raises(TurnInProgress) as refused:
            await user.send_text("second")
        assert refused.value.running_seq == first.seq
        # The channel allows a send to interrupt instead.
        await user.send_text("third", turn_policy="interrupt")
        third = await anext(turns)
        assert third.text == "third"
        assert await asyncio.wait_for(first.wait_cancelled(), WAIT) == "superseded"
        await third.reply("answered")
    texts = [m.text for m in await env.frames(conversation_id) if m.from_ == "user"]
    assert "second" not in texts
