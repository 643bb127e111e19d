"""An agent that takes turns and never answers them, for the takeover test (killed with -9).

Env: CONVERGER_URL, CONVERGER_AGENT_TOKEN, CONVERGER_AGENT_GROUP. Prints `ready <connectionId>
<since>` once welcomed and `turn <key>` for each turn it receives.
"""

from __future__ import annotations

import asyncio
import os

from converger import Agent


async def main() -> None:
    agent = Agent(
        os.environ["CONVERGER_URL"],
        os.environ["CONVERGER_AGENT_TOKEN"],
        group=os.environ.get("CONVERGER_AGENT_GROUP", "bot"),
    )
    welcome = await agent.connect()
    print(f"ready {welcome.connection_id} {welcome.since}", flush=True)
    async for turn in agent.turns():
        print(f"turn {turn.key}", flush=True)  # and never answer it


if __name__ == "__main__":
    asyncio.run(main())
