// Echo agent: answers every turn with an echo and counts the turns in the runtime state.
//
// With CONVERGER_ECHO_STREAM=1 it streams the echo word by word before committing it
// (turn.stream(), see streaming-agent.ts); the stored answer is the same.
//
// Environment:
//   CONVERGER_URL          the node, e.g. http://127.0.0.1:8080 (default) or its ws:// endpoint
//   CONVERGER_AGENT_TOKEN  a channel-scope token (`converger token issue --scope channel` or
//                          `POST /api/v1/converger/tokens/generate` with {"scope":"channel"})
//   CONVERGER_AGENT_GROUP  the group to join (default `echo`)
//   CONVERGER_ECHO_STREAM  `1` streams each echo before committing it (default `0`)
//
// Waits up to 10 minutes for the node to be ready (dev-node.ts), then connects. Prints
// `ready <connectionId> <since>` once connected; SIGTERM or Ctrl-C drains and exits 0.
//
// Run it (from sdk/typescript; compiles the examples and the SDK into build/):
//   npm run build:examples && CONVERGER_AGENT_TOKEN=… node build/examples/echo-agent.js

import { Agent, type Turn } from "../src/index.js";
import { serveTurns, waitForNode } from "./dev-node.js";

/** Answers one turn: `echo <n>: <text>`, where n counts this conversation's turns. */
async function echo(turn: Turn, streamed: boolean): Promise<void> {
    const previous = turn.runtime.state.count;
    const count = (typeof previous === "number" ? previous : 0) + 1;
    const text = `echo ${count}: ${turn.text ?? ""}`;
    if (!streamed) {
        await turn.typing(true);
        await turn.reply(text, { count });
        return;
    }
    const stream = turn.stream();
    for (const word of text.match(/\S+\s*/g) ?? []) {
        await stream.write(word);
    }
    await stream.finish(undefined, { count }); // commits the streamed text
}

async function main(): Promise<void> {
    const url = process.env.CONVERGER_URL ?? "http://127.0.0.1:8080";
    const token = process.env.CONVERGER_AGENT_TOKEN;
    if (token === undefined || token === "") {
        console.error("set CONVERGER_AGENT_TOKEN to a channel-scope token");
        process.exit(2);
    }
    const streamed = process.env.CONVERGER_ECHO_STREAM === "1";
    const agent = new Agent(url, token, { group: process.env.CONVERGER_AGENT_GROUP ?? "echo" });
    await waitForNode(url);
    await serveTurns(agent, (turn) => echo(turn, streamed));
}

main().catch((error: unknown) => {
    console.error(error);
    process.exit(1);
});
