#!/usr/bin/env python3
"""Echo agent: answers every turn with an echo and counts the turns in the runtime state.

With ``CONVERGER_ECHO_STREAM=1`` it streams the echo word by word before committing it
(``turn.stream()``, see ``llm_agent.py``); the stored answer is the same.

Environment:
    CONVERGER_URL          the node, e.g. http://127.0.0.1:8080 (default) or its ws:// endpoint
    CONVERGER_AGENT_TOKEN  a channel-scope token (``converger token issue --scope channel`` or
                           ``POST /api/v1/converger/tokens/generate`` with ``{"scope":"channel"}``)
    CONVERGER_AGENT_GROUP  the group to join (default ``echo``)
    CONVERGER_ECHO_STREAM  ``1`` streams each echo before committing it (default ``0``)

Waits up to 10 minutes for the node to be ready (``_dev_node.py``), then connects. Prints
``ready <connectionId> <since>`` once connected; SIGTERM or Ctrl-C drains and exits 0.

    CONVERGER_AGENT_TOKEN=... python3 sdk/python/examples/echo_agent.py
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal

from _dev_node import wait_for_node

from converger import Agent, Turn


async def main() -> None:
    """Connects, prints the ready line and answers turns until SIGTERM."""
    url = os.environ.get("CONVERGER_URL", "http://127.0.0.1:8080")
    agent = Agent(
        url,
        os.environ["CONVERGER_AGENT_TOKEN"],
        group=os.environ.get("CONVERGER_AGENT_GROUP", "echo"),
    )
    streamed = os.environ.get("CONVERGER_ECHO_STREAM", "0") == "1"

    @agent.turn
    async def echo(turn: Turn) -> None:
        count = int(turn.runtime.state.get("count", 0)) + 1
        text = f"echo {count}: {turn.text}"
        if not streamed:
            await turn.typing(True)
            await turn.reply(text, runtime={"count": count})
            return
        async with turn.stream() as stream:
            for word in re.findall(r"\S+\s*", text):
                await stream.text(word)
            await stream.finish(runtime={"count": count})  # commits the streamed text

    await wait_for_node(url)
    welcome = await agent.connect()
    print(f"ready {welcome.connection_id} {welcome.since}", flush=True)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, agent.stop)
    await agent.run(concurrency=8)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(main())
