// Streaming "LLM" agent: a fake model writes each answer word by word, the agent streams it.
//
// There is no model and no network call: generate() yields the words of a canned answer with a
// delay per word, as a model's token stream would. Each word reaches the conversation's end users
// as a `streamChunk` the moment it exists; once the answer is complete, the agent commits it as
// the turn's result, which ends the stream (docs/protocol.md §4.9):
//
//   user   text         "what is streaming?"
//   agent  streamChunk  "You "  "said "  …           (transient, index 0, 1, 2, …)
//   agent  text         the whole answer, stored with id = the streamId; streamEnd committed
//
// If the agent's connection drops mid-answer, the server aborts the stream (end users get
// `streamEnd` aborted, reason `disconnected`) and the next chunk throws StreamInterrupted. The
// agent then stops streaming but keeps generating, and finish() commits the whole answer over
// the next connection: the user still gets it, once.
//
// If the user stops the answer (`stop`, docs/protocol.md §3.9), turn.signal aborts: the model
// stops generating, nothing more is streamed, and the gateway settles the turn with the text
// streamed so far.
//
// Environment:
//   CONVERGER_URL            the node, e.g. http://127.0.0.1:8080 (default)
//   CONVERGER_AGENT_TOKEN    a channel-scope token; without it, on a development node started
//                            with `cargo run -p converger-cli -- serve` in the repository root
//                            (run this from inside the repository), the agent answers the demo
//                            page's channel (http://127.0.0.1:8080/demo): it asks
//                            `POST /demo/api/agent-token` with the generated admin token in
//                            `.converger/admin_token`
//   CONVERGER_AGENT_GROUP    the group to join (default `llm`)
//   CONVERGER_WORD_DELAY_MS  the fake model's delay per word, in ms (default 50)
//
// Run it (from sdk/typescript; compiles the examples and the SDK into build/):
//   npm run build:examples && CONVERGER_AGENT_TOKEN=… node build/examples/streaming-agent.js
//
// Started before the node is ready (its first build takes minutes), it waits up to 10 minutes for
// the node (dev-node.ts). Prints `ready <connectionId> <since>` once connected; SIGTERM or Ctrl-C
// drains and exits 0.

import { Agent, StreamInterrupted, type Turn } from "../src/index.js";
import { httpOrigin, readAdminToken, serveTurns, waitForNode } from "./dev-node.js";

/** Resolves after `ms`, or at once when `signal` aborts. */
function pause(ms: number, signal: AbortSignal): Promise<void> {
    return new Promise((resolve) => {
        const done = (): void => {
            clearTimeout(timer);
            signal.removeEventListener("abort", done);
            resolve();
        };
        const timer = setTimeout(done, ms);
        signal.addEventListener("abort", done, { once: true });
    });
}

/** The fake model: the answer to `prompt`, one word (with its trailing space) at a time. */
async function* generate(
    prompt: string,
    delayMs: number,
    signal: AbortSignal,
): AsyncGenerator<string> {
    const answer =
        `You said "${prompt}". Here is a considered answer, written one word at a time so that ` +
        "you can watch it arrive: streaming keeps the wait short, and the stored answer stays " +
        "exactly what you saw.";
    for (const word of answer.match(/\S+\s*/g) ?? []) {
        await pause(delayMs, signal); // the model "thinks"; a stop ends the thinking at once
        if (signal.aborted) {
            return;
        }
        yield word;
    }
}

/** Streams the fake model's answer to `turn`, then commits the whole of it. */
async function answer(turn: Turn, delayMs: number): Promise<void> {
    const words: string[] = [];
    let streaming = true;
    const stream = turn.stream();
    for await (const word of generate(turn.text ?? "", delayMs, turn.signal)) {
        words.push(word);
        if (!streaming) {
            continue;
        }
        try {
            await stream.write(word);
        } catch (error) {
            if (!(error instanceof StreamInterrupted)) {
                throw error;
            }
            // The viewers' stream was aborted with the connection; keep generating, finish()
            // commits the whole answer once the agent is connected again.
            console.error(`${error.message}; committing without streaming`);
            streaming = false;
        }
    }
    if (turn.cancelled) {
        return; // the stop ended the stream; the gateway settles the turn with what was streamed
    }
    const ack = await stream.finish([{ type: "text", data: { text: words.join("") } }]);
    console.error(
        `streamed ${words.length} words for ${turn.key}, stored as seq ${ack.seqs.join(",")}`,
    );
}

/** A token of the demo page's channel, asked for with the development node's admin token. */
async function demoAgentToken(url: string): Promise<string> {
    const adminToken = await readAdminToken();
    const response = await fetch(`${httpOrigin(url)}/demo/api/agent-token`, {
        method: "POST",
        headers: { authorization: `Bearer ${adminToken}` },
        signal: AbortSignal.timeout(10_000),
    });
    if (!response.ok) {
        throw new Error(`POST /demo/api/agent-token answered ${response.status}`);
    }
    const body: unknown = await response.json();
    const token =
        typeof body === "object" && body !== null ? Reflect.get(body, "token") : undefined;
    if (typeof token !== "string") {
        throw new Error("POST /demo/api/agent-token gave no token");
    }
    return token;
}

async function main(): Promise<void> {
    const url = process.env.CONVERGER_URL ?? "http://127.0.0.1:8080";
    await waitForNode(url);
    const token = process.env.CONVERGER_AGENT_TOKEN || (await demoAgentToken(url));
    const delayMs = Number(process.env.CONVERGER_WORD_DELAY_MS ?? "50");
    const agent = new Agent(url, token, { group: process.env.CONVERGER_AGENT_GROUP ?? "llm" });
    await serveTurns(agent, (turn) => answer(turn, delayMs));
}

main().catch((error: unknown) => {
    console.error(error);
    process.exit(1);
});
