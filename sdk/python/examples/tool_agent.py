#!/usr/bin/env python3
"""Tool-calling agent: a (fake) tool call, an ``interrupt`` for the user, then ``resume``.

It looks a table up with a fake tool, asks the user to confirm through an ``interrupt``
frame, and books the table when the user's ``resume`` arrives.

The conversation it produces::

    user   text             "table for 4 at 19:00"
    agent  tool_call        {"name": "find_table", "arguments": {"party": 4, "time": "19:00"}}
    agent  tool_result      {"name": "find_table", "result": {"table": "T4", ...}}
    agent  interrupt        id "int-…", {"question": "Book table T4 for 4 at 19:00?", ...}
    user   resume           {"interruptId": "int-…", "answer": "yes"}      (forwarded, transient)
    agent  interrupt_resolved  id "int-…", {"answer": "yes"}
    agent  text             "Booked table T4 for 4 at 19:00 (booking B-…)."

The answer to the turn is the first three frames, committed together. The ``resume`` is not a
turn: the agent continues with proactive frames, keyed by the interrupt id so that a repeated
``resume`` books nothing twice. Open interrupts are kept in memory here; a real agent keeps
them in the conversation's runtime state or its own store.

Environment:
    CONVERGER_URL          the node, e.g. http://127.0.0.1:8080 (default)
    CONVERGER_AGENT_TOKEN  a channel-scope token
    CONVERGER_AGENT_GROUP  the group to join (default ``tools``)

Waits up to 10 minutes for the node to be ready (``_dev_node.py``), then connects. Prints
``ready <connectionId> <since>`` once connected; SIGTERM or Ctrl-C drains and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from dataclasses import dataclass
from uuid import NAMESPACE_URL, uuid5

from _dev_node import wait_for_node

from converger import Agent, AgentEvent, Resume, Turn

log = logging.getLogger("tool_agent")


@dataclass(frozen=True)
class Pending:
    """An interrupt waiting for the user's answer."""

    conversation_id: str
    table: str
    party: int
    time: str


async def find_table(party: int, time: str) -> dict[str, object]:
    """The fake tool: a table that fits the party."""
    await asyncio.sleep(0)
    return {"table": f"T{party}", "party": party, "time": time, "free": True}


def build_agent(url: str, token: str, group: str) -> Agent:
    """The tool-calling agent with its turn and event handlers."""
    agent = Agent(url, token, group=group)
    pending: dict[str, Pending] = {}
    booked: dict[str, str] = {}  # interrupt id -> booking id (the "booking system")

    @agent.turn
    async def plan(turn: Turn) -> None:
        text = turn.text or ""
        numbers = re.search(r"(\d+)\D+(\d{1,2}:\d{2})", text)
        if numbers is None:
            await turn.reply("Tell me the party size and the time, e.g. 'table for 4 at 19:00'.")
            return
        party, time = int(numbers.group(1)), numbers.group(2)
        arguments = {"party": party, "time": time}
        await turn.run_status({"phase": "tool", "tool": "find_table"})
        result = await find_table(party, time)
        interrupt_id = f"int-{uuid5(NAMESPACE_URL, turn.key).hex}"
        pending[interrupt_id] = Pending(turn.conversation_id, str(result["table"]), party, time)
        await turn.reply(
            [
                {"type": "tool_call", "data": {"name": "find_table", "arguments": arguments}},
                {"type": "tool_result", "data": {"name": "find_table", "result": result}},
                {
                    "type": "interrupt",
                    "id": interrupt_id,
                    "data": {
                        "question": f"Book table {result['table']} for {party} at {time}?",
                        "options": ["yes", "no"],
                    },
                },
            ]
        )

    @agent.event
    async def on_event(event: AgentEvent) -> None:
        if not isinstance(event, Resume):
            return
        interrupt_id = str(event.data.get("interruptId", ""))
        answer = str(event.data.get("answer", ""))
        asked = pending.get(interrupt_id)
        if asked is None or asked.conversation_id != event.conversation_id:
            await agent.relay_error(
                event.conversation_id, "not_interrupted", "no open interrupt with that id"
            )
            return
        await agent.send(
            event.conversation_id,
            {"type": "interrupt_resolved", "id": interrupt_id, "data": {"answer": answer}},
            client_id=f"resolved-{interrupt_id}",
        )
        if answer == "yes":
            booking = booked.setdefault(interrupt_id, f"B-{len(booked) + 1}")
            reply = f"Booked table {asked.table} for {asked.party} at {asked.time} ({booking})."
        else:
            reply = "No booking made."
        await agent.send(event.conversation_id, reply, client_id=f"done-{interrupt_id}")
        pending.pop(interrupt_id, None)

    return agent


async def main() -> None:
    """Connects, prints the ready line and serves until SIGTERM."""
    url = os.environ.get("CONVERGER_URL", "http://127.0.0.1:8080")
    agent = build_agent(
        url,
        os.environ["CONVERGER_AGENT_TOKEN"],
        os.environ.get("CONVERGER_AGENT_GROUP", "tools"),
    )
    await wait_for_node(url)
    welcome = await agent.connect()
    print(f"ready {welcome.connection_id} {welcome.since}", flush=True)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, agent.stop)
    await agent.run(concurrency=4)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(main())
