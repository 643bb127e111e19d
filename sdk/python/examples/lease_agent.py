#!/usr/bin/env python3
"""Lease-mode agent: charges a (fake, in-process) payment service once per turn revision.

Each turn is claimed for this connection before delivery (``hello.claim = "lease"``) and comes
with a fence; the answer carries it back, so a worker that lost the turn (its connection
dropped and another member took over) is told with ``LeaseLost`` instead of overwriting the
answer. The turn key (``<conversation>:<seq>:<revision>``) is the payment's idempotency key:
a turn answered twice charges once, and a new revision (an edit, a regeneration) is a new key
on purpose.

    user   text  "pay 42"
    agent  text  "charged 42.00 (charge ch-1, new) for turn <key>, fence 1"

Environment:
    CONVERGER_URL          the node, e.g. http://127.0.0.1:8080 (default)
    CONVERGER_AGENT_TOKEN  a channel-scope token
    CONVERGER_AGENT_GROUP  the group to join (default ``payments``)

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

from _dev_node import wait_for_node

from converger import Agent, LeaseLost, Turn

log = logging.getLogger("lease_agent")


@dataclass(frozen=True)
class Charge:
    """A payment; ``created`` is false when the key had been charged before."""

    id: str
    amount: float
    created: bool


class FakePaymentService:
    """Stands in for an external API that takes an idempotency key (Stripe-style)."""

    def __init__(self) -> None:
        self.charges: dict[str, Charge] = {}

    async def charge(self, amount: float, *, idempotency_key: str) -> Charge:
        """Charges ``amount`` once per ``idempotency_key``."""
        await asyncio.sleep(0.01)  # a network round trip
        known = self.charges.get(idempotency_key)
        if known is not None:
            return Charge(known.id, known.amount, created=False)
        charge = Charge(f"ch-{len(self.charges) + 1}", amount, created=True)
        self.charges[idempotency_key] = charge
        return charge


def build_agent(url: str, token: str, group: str, service: FakePaymentService) -> Agent:
    """The lease-mode agent, charging through ``service``."""
    agent = Agent(url, token, group=group, lease=True)

    @agent.turn
    async def pay(turn: Turn) -> None:
        match = re.search(r"(\d+(?:\.\d+)?)", turn.text or "")
        if match is None:
            await turn.reply("How much? Say e.g. 'pay 42'.")
            return
        charge = await service.charge(float(match.group(1)), idempotency_key=turn.key)
        state = "new" if charge.created else "already done"
        text = (
            f"charged {charge.amount:.2f} (charge {charge.id}, {state}) "
            f"for turn {turn.key}, fence {turn.fence}"
        )
        try:
            await turn.reply(text)
        except LeaseLost as lost:
            # Another worker holds the turn now (fence lost.current_fence) and answers it,
            # with the same key, so the charge is not repeated. Drop this answer.
            log.warning("lost turn %s to fence %s", turn.key, lost.current_fence)

    return agent


async def main() -> None:
    """Connects, prints the ready line and answers turns until SIGTERM."""
    url = os.environ.get("CONVERGER_URL", "http://127.0.0.1:8080")
    agent = build_agent(
        url,
        os.environ["CONVERGER_AGENT_TOKEN"],
        os.environ.get("CONVERGER_AGENT_GROUP", "payments"),
        FakePaymentService(),
    )
    await wait_for_node(url)
    welcome = await agent.connect()
    print(f"ready {welcome.connection_id} {welcome.since} lease {welcome.lease_ms}", flush=True)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, agent.stop)
    await agent.run(concurrency=4)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(main())
