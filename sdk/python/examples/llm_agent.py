#!/usr/bin/env python3
"""Streaming "LLM" agent: a fake model writes each answer word by word, the agent streams it.

There is no model and no network call: ``generate()`` yields the words of a canned answer with
a delay per word, as a model's token stream would. Each word goes to the conversation's end
users as a ``streamChunk`` the moment it exists; once the answer is complete, the agent commits
it as the turn's result, which ends the stream (``docs/protocol.md`` §4.9)::

    user   text         "what is streaming?"
    agent  streamChunk  "You "  "said "  …                (transient, index 0, 1, 2, …)
    agent  text         the whole answer, stored with id = the streamId; streamEnd committed

If the agent's connection drops mid-answer, the server aborts the stream (end users get
``streamEnd`` aborted, reason ``disconnected``) and the next chunk raises ``StreamInterrupted``.
The agent then stops streaming but keeps generating, and ``finish()`` commits the whole answer
over the next connection: the user still gets it, once.

If the user stops the answer (``stop``, ``docs/protocol.md`` §3.9), the SDK cancels the turn's
handler: the model stops generating, nothing more is streamed, and the gateway settles the turn
with the text streamed so far.

Environment:
    CONVERGER_URL            the node, e.g. http://127.0.0.1:8080 (default)
    CONVERGER_AGENT_TOKEN    a channel-scope token; without it, on a development node started
                             with ``cargo run -p converger-cli -- serve`` in the repository
                             root, the agent answers the demo page's channel
                             (http://127.0.0.1:8080/demo): it asks ``POST /demo/api/agent-token``
                             with the generated admin token in the repository's
                             ``.converger/admin_token``
    CONVERGER_AGENT_GROUP    the group to join (default ``llm``)
    CONVERGER_WORD_DELAY_MS  the fake model's delay per word, in ms (default 50)

Started before the node is ready (its first build takes minutes), it waits up to 10 minutes
for the node (``_dev_node.py``). Prints ``ready <connectionId> <since>`` once connected;
SIGTERM or Ctrl-C drains and exits 0.

    CONVERGER_AGENT_TOKEN=... python3 sdk/python/examples/llm_agent.py
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from collections.abc import AsyncIterator

import httpx
from _dev_node import read_admin_token, wait_for_node

from converger import Agent, StreamInterrupted, Turn

log = logging.getLogger("llm_agent")


async def generate(prompt: str, delay: float) -> AsyncIterator[str]:
    """The fake model: the answer to ``prompt``, one word (with its trailing space) at a time."""
    answer = (
        f'You said "{prompt}". Here is a considered answer, written one word at a time so that '
        "you can watch it arrive: streaming keeps the wait short, and the stored answer stays "
        "exactly what you saw."
    )
    for word in re.findall(r"\S+\s*", answer):
        await asyncio.sleep(delay)  # the model "thinks"
        yield word


def build_agent(url: str, token: str, group: str, delay: float) -> Agent:
    """The streaming agent, with a fake model that waits ``delay`` seconds per word."""
    agent = Agent(url, token, group=group)

    @agent.turn
    async def answer(turn: Turn) -> None:
        words: list[str] = []
        streaming = True
        async with turn.stream() as stream:
            async for word in generate(turn.text or "", delay):
                words.append(word)
                if not streaming:
                    continue
                try:
                    await stream.text(word)
                except StreamInterrupted as interrupted:
                    # The viewers' stream was aborted with the connection; keep generating,
                    # finish() commits the whole answer once the agent is connected again.
                    log.warning("%s; committing without streaming", interrupted)
                    streaming = False
            ack = await stream.finish("".join(words))
        log.info("streamed %d words for %s, stored as seq %s", len(words), turn.key, ack.seqs)

    return agent


async def demo_agent_token(url: str) -> str:
    """A token of the demo page's channel, asked for with the development node's admin token."""
    admin_token = await read_admin_token()
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as http:
        response = await http.post(
            "/demo/api/agent-token", headers={"Authorization": f"Bearer {admin_token}"}
        )
        response.raise_for_status()
        token: str = response.json()["token"]
        return token


async def main() -> None:
    """Connects, prints the ready line and answers turns until SIGTERM."""
    url = os.environ.get("CONVERGER_URL", "http://127.0.0.1:8080")
    await wait_for_node(url)
    token = os.environ.get("CONVERGER_AGENT_TOKEN") or await demo_agent_token(url)
    agent = build_agent(
        url,
        token,
        os.environ.get("CONVERGER_AGENT_GROUP", "llm"),
        int(os.environ.get("CONVERGER_WORD_DELAY_MS", "50")) / 1000,
    )
    welcome = await agent.connect()
    print(f"ready {welcome.connection_id} {welcome.since}", flush=True)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, agent.stop)
    await agent.run(concurrency=8)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(main())
