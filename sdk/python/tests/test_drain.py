"""A draining node: its agents reconnect elsewhere, no sooner than the server's retryAfterMs."""

from __future__ import annotations

import asyncio
import shutil
import signal

from support import FAST, WAIT, Env, Proxy, Recorder, start_node

from converger import Agent, Conversation, Turn


async def test_a_draining_nodes_agent_reconnects_to_another_node_after_retry_after(
    env: Env, proxy: Proxy
) -> None:
    # A second node over the same database (in embedded mode: the first node's Postgres).
    draining = start_node(
        env.node.database_url,
        {"CONVERGER_SEEDS": env.node.gossip_addr},
        state_dir=env.node.state_dir if env.node.embedded else None,
    )
    try:
        acked = Recorder()
        proxy.target_port = draining.port
        agent = Agent(proxy.url, await env.agent_token(), group="bot", backoff=FAST)

        @agent.turn
        async def echo(turn: Turn) -> None:
            await turn.reply(f"#{turn.seq} {turn.text}")
            acked.append(turn.seq)

        await agent.connect()
        await agent.wait_eligible()
        runner = asyncio.create_task(agent.run())
        # The node drains (SIGTERM); new connections through the proxy reach the other node.
        proxy.target_port = env.node.port
        draining.process.send_signal(signal.SIGTERM)
        await agent.wait_connected(WAIT, connections=2)
        closed = agent.last_disconnect
        assert closed is not None and closed.code == 1012
        assert closed.retry_after is not None and 0.05 <= closed.retry_after <= 0.1
        assert agent.connected_at is not None
        assert agent.connected_at - closed.at >= closed.retry_after  # waited at least the hint

        await agent.wait_eligible()
        _, user_token = await env.conversation()
        async with Conversation(env.url, user_token, backoff=FAST) as user:
            await user.send_text("on the other node")
        await acked.wait_for(1)
        agent.stop()
        await runner
    finally:
        draining.stop()
        if not draining.guest:
            shutil.rmtree(draining.state_dir, ignore_errors=True)
