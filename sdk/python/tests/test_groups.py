"""Two SDK agents in one group: one answer per turn, and takeover of a killed member's turn."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from support import FAST, Env, Recorder, Script, owner, turn_of

from converger import Agent, Turn

HELPERS = Path(__file__).parent / "helpers"


def answering_agent(env: Env, token: str, name: str, acked: Recorder) -> Agent:
    agent = Agent(env.url, token, group="bot", backoff=FAST)

    @agent.turn
    async def answer(turn: Turn) -> None:
        await turn.reply(f"#{turn.seq} by {name}")
        acked.append((turn.conversation_id, turn.seq))

    return agent


async def test_two_agents_in_one_group_answer_each_turn_exactly_once(env: Env) -> None:
    token = await env.agent_token()
    acked = Recorder()
    agents = {name: answering_agent(env, token, name, acked) for name in ("A", "B")}
    for agent in agents.values():
        await agent.connect()
    for agent in agents.values():
        await agent.wait_eligible()
    runners = [asyncio.create_task(agent.run(concurrency=4)) for agent in agents.values()]
    members = {agent.welcome.connection_id: name for name, agent in agents.items()}

    conversations = [await env.conversation(f"user-{n}") for n in range(6)]
    turns: dict[str, list[int]] = {}
    for conversation_id, user_token in conversations:
        for n in range(3):
            posted = await env.rest.post_activity(
                user_token, conversation_id, f"turn {n}", idempotency_key=f"t-{n}"
            )
            turns.setdefault(conversation_id, []).append(posted.seq)

    await acked.wait_for(18)
    for agent in agents.values():
        agent.stop()
    await asyncio.gather(*runners)

    assert sorted(acked.items) == sorted((c, seq) for c, seqs in turns.items() for seq in seqs)
    for conversation_id, seqs in turns.items():
        answers = await env.answers(conversation_id)
        assert sorted(turn_of(answer) for answer in answers) == seqs, "one answer per turn"
        # every turn of a conversation went to its owner (rendezvous hashing, ADR 0006)
        expected = members[owner(conversation_id, list(members))]
        assert {(answer.text or "").rsplit(" ", 1)[1] for answer in answers} == {expected}


async def test_a_killed_members_unanswered_turn_is_taken_over_and_answered_once(env: Env) -> None:
    token = await env.agent_token()
    hanging = await Script(
        HELPERS / "hanging_agent.py",
        {"CONVERGER_URL": env.url, "CONVERGER_AGENT_TOKEN": token, "CONVERGER_AGENT_GROUP": "bot"},
    ).start()
    try:
        ready = await hanging.line("ready ")
        since = int(ready.split()[2])
        await asyncio.sleep(
            max(since / 1000 - time.time() + 0.02, 0)
        )  # the node clock passes since
        conversation_id, user_token = await env.conversation()
        posted = await env.rest.post_activity(user_token, conversation_id, "who answers?")
        assert (await hanging.line("turn ")).endswith(f":{posted.seq}:0")

        acked = Recorder()
        survivor = answering_agent(env, token, "B", acked)
        await survivor.connect()
        runner = asyncio.create_task(survivor.run())
        hanging.kill()  # mid-turn: the turn is delivered and unanswered
        await hanging.wait_killed()
        await acked.wait_for(1)
        survivor.stop()
        await runner
    finally:
        hanging.kill()
    assert acked.items == [(conversation_id, posted.seq)]
    answers = await env.answers(conversation_id)
    assert [(turn_of(a), a.text) for a in answers] == [(posted.seq, f"#{posted.seq} by B")]
