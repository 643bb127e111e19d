from __future__ import annotations

import asyncio

from support import FAST, Env, next_message

from converger import Agent, Conversation, Turn


async def test_an_echo_agent_answers_a_user(env: Env) -> None:
    token = await env.agent_token()
    agent = Agent(env.url, token, group="echo", backoff=FAST)

    @agent.turn
    async def echo(turn: Turn) -> None:
        await turn.reply(f"#{turn.seq} echo: {turn.text}")

    await agent.connect()
    await agent.wait_eligible()
    runner = asyncio.create_task(agent.run())
    conversation_id, user_token = await env.conversation()
    async with Conversation(env.url, user_token, backoff=FAST) as user:
        ack = await user.send_text("hello")
        assert ack.seq == 1
        answer = await next_message(user, lambda m: m.from_ == "bot")
        assert answer.text == "#1 echo: hello"
    agent.stop()
    await runner
