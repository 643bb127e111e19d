"""A draining node: its agents reconnect elsewhere, no sooner than the server's retryAfterMs."""

from __future__ import annotations

import asyncio
import signal

import pytest
from support import FAST, WAIT, Env, Proxy, Recorder, start_node

from converger import Agent, Conversation, RestClient, Turn


async def test_a_draining_nodes_agent_reconnects_to_another_node_after_retry_after(
    env: Env, proxy: Proxy
) -> None:
    if env.node.embedded:
        pytest.skip("a second node needs the shared test Postgres")
    second = start_node(env.node.database_url, {"CONVERGER_SEEDS": env.node.gossip_addr})
    try:
        acked = Recorder()
        agent = Agent(proxy.url, await env.agent_token(), group="bot", backoff=FAST)

        @agent.turn
        async def echo(turn: Turn) -> None:
            await turn.reply(f"#{turn.seq} {turn.text}")
            acked.append(turn.seq)

        await agent.connect()
        await agent.wait_eligible()
        runner = asyncio.create_task(agent.run())
        # The first node drains (SIGTERM); new connections through the proxy reach the second.
        proxy.target_port = second.port
        env.node.process.send_signal(signal.SIGTERM)
        await agent.wait_connected(WAIT, connections=2)
        closed = agent.last_disconnect
        assert closed is not None and closed.code == 1012
        assert closed.retry_after is not None and 0.05 <= closed.retry_after <= 0.1
        assert agent.connected_at is not None
        assert agent.connected_at - closed.at >= closed.retry_after  # waited at least the hint

        await agent.wait_eligible()
        async with RestClient(second.base_url) as rest:
            created = await rest.mint_conversation(env.secret, "alice")
        user_token = created.token
        async with Conversation(second.base_url, user_token, backoff=FAST) as user:
            await user.send_text("on the second node")
        await acked.wait_for(1)
        agent.stop()
        await runner
    finally:
        second.stop()
