// The Agent against real nodes: typed turns answered once, streamed answers, cancel, groups,
// reconnects with resent answers, fatal closes, lease mode, retryable refusals.
// Mirrors sdk/python/tests/test_agent.py, test_streams.py, test_groups.py and test_faults.py.

import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { WebSocket } from "ws";
import {
    Agent,
    type AgentEvent,
    type AgentOptions,
    parseAgentEvent,
    type Turn,
    TurnCancelled,
} from "../src/agent.js";
import type { WebSocketLike } from "../src/connection.js";
import type { Conversation } from "../src/conversation.js";
import {
    AckTimeout,
    ClientClosed,
    FatalClose,
    LeaseLost,
    StaleRuntime,
    StreamInterrupted,
    TurnConflict,
    TurnStopped,
    TurnSuperseded,
} from "../src/errors.js";
import type { Message } from "../src/frames.js";
import { resultClientId } from "../src/internal.js";
import { parseObject } from "../src/json.js";
import {
    eventually,
    FAST,
    firstOf,
    fromBot,
    LIMIT,
    Proxy,
    setupTenant,
    startNode,
    type Tenant,
    WAIT_MS,
    withNode,
} from "./support.js";

/** Only errors: the reconnects these tests cause on purpose would fill the output. */
const QUIET = { error: (message: string) => console.error(message) };

// A short stop grace: the stop test waits for the gateway's settlement.
const mainNode = withNode({ CONVERGER_TURNS__STOP_GRACE_MS: "300" });

/** A connected member whose `since` has passed (turns sent from now on reach it). */
async function startedAgent(
    url: string,
    token: string,
    options: AgentOptions = {},
): Promise<Agent> {
    const agent = new Agent(url, token, { group: "bot", backoff: FAST, logger: QUIET, ...options });
    await agent.connect();
    await agent.waitEligible();
    return agent;
}

/** `promise`, or a failure naming `what` once WAIT_MS passed. */
async function bounded<T>(promise: Promise<T>, what: string): Promise<T> {
    let timer: ReturnType<typeof setTimeout> | undefined;
    const timeout = new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(new Error(`timed out waiting for ${what}`)), WAIT_MS);
    });
    try {
        return await Promise.race([promise, timeout]);
    } finally {
        clearTimeout(timer);
    }
}

/** A fresh tenant, a started agent of group "bot" and an end user's open conversation. */
async function scene(): Promise<{
    tenant: Tenant;
    agent: Agent;
    conversationId: string;
    user: Conversation;
}> {
    const tenant = await setupTenant(mainNode());
    const agent = await startedAgent(tenant.url, await tenant.agentToken());
    const { conversationId, user } = await tenant.endUser();
    return { tenant, agent, conversationId, user };
}

/** The next turn the agent hands out, within WAIT_MS. */
function nextTurn(agent: Agent): Promise<Turn> {
    return firstOf(agent.turns(), () => true);
}

/** The next persistent frame the end user sees that matches `predicate`. */
function nextMessage(
    user: Conversation,
    predicate: (message: Message) => boolean,
): Promise<Message> {
    return firstOf(user.messages(), predicate);
}

/** The stored answers (agent frames) of a conversation, in seq order. */
async function answers(tenant: Tenant, conversationId: string): Promise<Message[]> {
    const frames = await tenant.frames(conversationId);
    return frames.filter((frame) => frame.sender?.role === "agent");
}

/** The turn seq an answer answers (its `meta.turn`, else the `#<seq>` its text starts with). */
function answeredSeq(message: Message): number {
    const meta = message.raw.meta;
    const turn = typeof meta === "object" && meta !== null ? Reflect.get(meta, "turn") : undefined;
    const seq = typeof turn === "object" && turn !== null ? Reflect.get(turn, "seq") : undefined;
    if (typeof seq === "number") {
        return seq;
    }
    return Number((message.text ?? "").match(/^#(\d+)/)?.[1] ?? Number.NaN);
}

/**
 * A `ws` socket that records what the agent writes (the hello of each connection) and which
 * sockets the agent made; the network stays real (faults are the Proxy's).
 */
class TestSocket implements WebSocketLike {
    /** The socket made last (the agent's current connection). */
    static latest: TestSocket | undefined;
    /** Every socket made so far, oldest first. */
    static made: TestSocket[] = [];
    /** What the agent wrote on this socket. */
    readonly sent: string[] = [];
    readonly #inner: WebSocket;

    constructor(url: string, protocols?: string | string[]) {
        this.#inner = new WebSocket(url, protocols);
        TestSocket.latest = this;
        TestSocket.made.push(this);
    }

    /** The URL this socket connected to. */
    get url(): string {
        return this.#inner.url;
    }

    get readyState(): number {
        return this.#inner.readyState;
    }

    get bufferedAmount(): number {
        return this.#inner.bufferedAmount;
    }

    send(data: string): void {
        this.sent.push(data);
        this.#inner.send(data);
    }

    close(code?: number, reason?: string): void {
        this.#inner.close(code, reason);
    }

    addEventListener(
        type: "open" | "message" | "close" | "error",
        listener: (event: {
            type: string;
            data?: unknown;
            code?: number;
            reason?: string;
            message?: string;
        }) => void,
    ): void {
        if (type === "message") {
            this.#inner.on("message", (data, isBinary) =>
                listener({ type, data: isBinary ? data : data.toString() }),
            );
        } else if (type === "close") {
            this.#inner.on("close", (code, reason) =>
                listener({ type, code, reason: reason.toString() }),
            );
        } else if (type === "error") {
            this.#inner.on("error", (error) => listener({ type, message: error.message }));
        } else {
            this.#inner.on("open", () => listener({ type }));
        }
    }
}

describe("agent", () => {
    test(
        "a turn is delivered once, typed, and answered once; the runtime travels to the next turn",
        LIMIT,
        async () => {
            const { tenant, agent, conversationId, user } = await scene();
            try {
                const events = user.events();
                await user.sendText("hello");
                const turn = await nextTurn(agent);
                assert.deepEqual(
                    [turn.conversationId, turn.seq, turn.revision],
                    [conversationId, 1, 0],
                );
                assert.equal(turn.key, `${conversationId}:1:0`);
                assert.equal(turn.reason, undefined);
                assert.equal(turn.fence, undefined);
                assert.equal(turn.text, "hello");
                assert.equal(turn.type, "text");
                assert.deepEqual(turn.runtime, { version: 0, state: {} });
                assert.equal(turn.participant?.id, "alice");
                assert.equal(turn.channelId, tenant.channelId);
                assert.equal(turn.message?.from, "user");
                assert.equal(turn.signal.aborted, false);

                // typing and run status reach the end user as transient events
                assert.equal(await turn.typing(true), true);
                assert.equal(await turn.runStatus({ phase: "thinking" }), true);
                const typing = await firstOf(events, (event) => event.kind === "typing");
                assert.equal(typing.kind === "typing" && typing.isTyping, true);
                const run = await firstOf(events, (event) => event.kind === "run");
                assert.deepEqual(run.kind === "run" ? run.data : undefined, { phase: "thinking" });

                const ack = await turn.reply(`#${turn.seq} hi alice`, { count: 1 });
                assert.deepEqual(ack.seqs, [2]);
                assert.equal(ack.duplicate, false);
                assert.equal(turn.ack, ack);
                const answer = await nextMessage(user, fromBot);
                assert.equal(answer.seq, 2);
                assert.equal(answer.text, "#1 hi alice");
                assert.equal(answer.sender?.id, "bot"); // the group name

                await user.sendText("again");
                const second = await nextTurn(agent);
                assert.equal(second.seq, 3);
                assert.deepEqual(second.runtime, { version: 1, state: { count: 1 } });
                await second.answer([]); // an empty answer completes the turn, storing nothing
                assert.deepEqual(agent.unacked, []);
            } finally {
                await user.close();
                await agent.close();
            }
            assert.deepEqual(
                (await answers(tenant, conversationId)).map((message) => message.seq),
                [2],
            );
        },
    );

    test(
        "run() answers a conversation's turns one at a time, each on the runtime the previous wrote",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const agent = await startedAgent(tenant.url, await tenant.agentToken());
            const running = agent.run(
                async (turn) => {
                    const previous = turn.runtime.state.count;
                    const count = (typeof previous === "number" ? previous : 0) + 1;
                    await new Promise((resolve) => setImmediate(resolve)); // let other turns pile up
                    await turn.reply(`#${turn.seq} count ${count}`, { count });
                },
                { concurrency: 4 },
            );
            const { conversationId, user } = await tenant.endUser();
            try {
                for (const text of ["a", "b", "c"]) {
                    await user.sendText(text); // three turns before any answer
                }
                const seen: Message[] = [];
                for (let n = 0; n < 3; n += 1) {
                    seen.push(await nextMessage(user, fromBot));
                }
                const counts = seen
                    .sort((a, b) => answeredSeq(a) - answeredSeq(b))
                    .map((message) => message.text?.split(" ").slice(1).join(" "));
                assert.deepEqual(counts, ["count 1", "count 2", "count 3"]);
            } finally {
                agent.stop();
                await running;
                await user.close();
            }
            assert.equal((await answers(tenant, conversationId)).length, 3);
        },
    );

    test(
        "refusals are typed: stale runtime, superseded revision, conflict; a resend is a duplicate",
        LIMIT,
        async () => {
            const { tenant, agent, conversationId, user } = await scene();
            try {
                await user.sendText("one");
                await user.sendText("two");
                const first = await nextTurn(agent);
                const second = await nextTurn(agent);
                // both were handed out before any answer: both read version 0
                assert.equal(first.runtime.version, 0);
                assert.equal(second.runtime.version, 0);
                await first.reply(`#${first.seq}`, { n: 1 });
                const stale = await second.reply(`#${second.seq}`, { n: 1 }).then(
                    () => undefined,
                    (error: unknown) => error,
                );
                assert.ok(stale instanceof StaleRuntime, String(stale));
                assert.equal(stale.currentVersion, 1);
                assert.equal(stale.retryable, true);
                await second.reply(`#${second.seq}`, { n: 2 }, { runtimeVersion: 1 });

                // an edit makes the original revision's answer superseded
                const sent = await user.sendText("what is 2+2");
                const original = await nextTurn(agent);
                const edited = await user.edit("what is 3+3", { seq: sent.seq });
                assert.equal(edited.turn?.revision, 1);
                const revised = await nextTurn(agent);
                assert.deepEqual(
                    [revised.seq, revised.revision, revised.reason],
                    [original.seq, 1, "edit"],
                );
                assert.equal(revised.text, "what is 3+3");
                await assert.rejects(original.reply("4"), (error: unknown) => {
                    assert.ok(error instanceof TurnSuperseded);
                    assert.equal(error.latestRevision, 1);
                    return true;
                });
                const ack = await revised.reply("6");
                await assert.rejects(revised.reply("six"), (error: unknown) => {
                    assert.ok(error instanceof TurnConflict);
                    assert.deepEqual(error.committedSeqs, ack.seqs);
                    return true;
                });
                const again = await revised.reply("6"); // the same answer again: a duplicate
                assert.equal(again.duplicate, true);
                assert.deepEqual(again.seqs, ack.seqs);
            } finally {
                await user.close();
                await agent.close();
            }
            assert.deepEqual(
                (await answers(tenant, conversationId)).map((message) => message.text),
                ["#1", "#2", "6"],
            );
        },
    );

    test(
        "a streamed answer reaches the end user chunk by chunk and commits under the stream's id",
        LIMIT,
        async () => {
            const { tenant, agent, conversationId, user } = await scene();
            try {
                assert.equal(agent.welcome.streams, true);
                const updates = user.streamUpdates();
                await user.sendText("hi");
                const turn = await nextTurn(agent);
                const card = { type: "card", title: "a card" };
                const stream = turn.stream();
                assert.match(stream.streamId, new RegExp(`^stream-${turn.seq}-0-[0-9a-f]{16}$`));
                await stream.write("Hel");
                await stream.write(""); // sends nothing
                await stream.write("lo");
                await stream.chunk(card);
                // the end user sees every chunk while the answer is still being written
                const seen = [];
                for (let n = 0; n < 3; n += 1) {
                    seen.push(await firstOf(updates, (update) => update.chunk !== undefined));
                }
                assert.deepEqual(
                    seen.map((update) => update.chunk?.index),
                    [0, 1, 2],
                );
                assert.deepEqual(
                    seen.map((update) => update.chunk?.text),
                    ["Hel", "lo", undefined],
                );
                assert.deepEqual(seen[2]?.chunk?.chunk, card);
                assert.equal(seen[0]?.chunk?.turn?.seq, turn.seq);
                assert.equal(stream.chunksSent, 3);

                const ack = await stream.finish();
                assert.equal(stream.state, "finished");
                assert.equal(turn.ack, ack);
                const answer = await nextMessage(user, fromBot);
                assert.deepEqual([answer.id, answer.text], [stream.streamId, "Hello"]);
                assert.deepEqual(ack.seqs, [answer.seq]);
                const end = await firstOf(updates, (update) => update.end !== undefined);
                assert.equal(end.streamId, stream.streamId);
                assert.equal(end.end?.committed, true);
                assert.equal(user.streams.get(stream.streamId)?.text, "Hello");
                await assert.rejects(stream.write("late"), /finished/);
            } finally {
                await user.close();
                await agent.close();
            }
            const stored = await answers(tenant, conversationId);
            assert.equal(stored.length, 1);
        },
    );

    test(
        "streamWith() aborts the stream when its writer throws, and a new stream answers",
        LIMIT,
        async () => {
            const { tenant, agent, conversationId, user } = await scene();
            try {
                const updates = user.streamUpdates();
                await user.sendText("hi");
                const turn = await nextTurn(agent);
                let failedId = "";
                await assert.rejects(
                    turn.streamWith(async (stream) => {
                        failedId = stream.streamId;
                        await stream.write("about to fail");
                        await firstOf(updates, (update) => update.chunk?.index === 0);
                        throw new Error("the model failed");
                    }),
                    /the model failed/,
                );
                const aborted = await firstOf(updates, (update) => update.end !== undefined);
                assert.equal(aborted.streamId, failedId);
                assert.deepEqual([aborted.end?.status, aborted.end?.reason], ["aborted", "error"]);

                const committed = await turn.streamWith(async (stream) => {
                    await stream.write("second ");
                    await stream.write("try");
                    return stream;
                });
                assert.equal(committed.state, "finished");
                const answer = await nextMessage(user, fromBot);
                assert.deepEqual([answer.id, answer.text], [committed.streamId, "second try"]);
            } finally {
                await user.close();
                await agent.close();
            }
            assert.deepEqual(
                (await answers(tenant, conversationId)).map((message) => message.text),
                ["second try"],
            );
        },
    );

    test(
        "an end user's stop aborts turn.signal and the turn settles with what was streamed",
        LIMIT,
        async () => {
            const { tenant, agent, conversationId, user } = await scene();
            const streamed: string[] = [];
            const handled: Turn[] = [];
            const running = agent.run(async (turn) => {
                handled.push(turn);
                await turn.streamWith(async (stream) => {
                    for (const word of ["Once ", "upon ", "a ", "time"]) {
                        if (turn.signal.aborted) {
                            return;
                        }
                        await stream.write(word);
                        streamed.push(word);
                        if (streamed.length === 2) {
                            await turn.waitCancelled(); // a model that waits for more tokens
                        }
                    }
                });
            });
            try {
                const updates = user.streamUpdates();
                await user.sendText("tell me a story");
                await eventually(() => streamed.length === 2, { what: "two streamed words" });
                // a chunk the agent wrote is in the stream once its node took it, and the stop
                // ends the stream after the last chunk taken: stop once the user saw both words
                await firstOf(updates, (update) => update.chunk?.index === 1);
                const stopped = await user.stop();
                assert.equal(stopped.stopped, true);
                const turn = handled[0];
                assert.ok(turn !== undefined);
                await eventually(() => turn.signal.aborted, { what: "the turn's signal aborts" });
                assert.equal(turn.cancelled, true);
                assert.equal(turn.cancelReason, "stopped");
                assert.equal(await turn.waitCancelled(), "stopped");
                // the gateway settles the turn after its grace period with the text streamed
                const settled = await nextMessage(
                    user,
                    (message) => message.data.status === "stopped",
                );
                assert.equal(settled.text, "Once upon ");
                assert.deepEqual(streamed, ["Once ", "upon "]);
                await assert.rejects(turn.reply("the whole story"), TurnStopped);
            } finally {
                agent.stop();
                await running;
                await user.close();
            }
            const results = (await tenant.frames(conversationId)).filter(
                (frame) => frame.sender?.role !== "user",
            );
            assert.deepEqual(
                results.map((frame) => frame.text),
                ["Once upon "],
            );
        },
    );

    test(
        "two agents in one group: each conversation's turns go to one of them, each answered once",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const token = await tenant.agentToken();
            const answeredBy = new Map<string, Set<string>>();
            const agents = [
                await startedAgent(tenant.url, token),
                await startedAgent(tenant.url, token),
            ];
            // Both are eligible only once the later one's since passed.
            await agents[0]?.waitEligible();
            const runs = agents.map((agent, index) =>
                agent.run(
                    async (turn) => {
                        const name = `agent-${index}`;
                        await turn.reply(`#${turn.seq} by ${name}`);
                        const names = answeredBy.get(turn.conversationId) ?? new Set();
                        names.add(name);
                        answeredBy.set(turn.conversationId, names);
                    },
                    { concurrency: 4 },
                ),
            );
            const posted = new Map<string, number[]>();
            try {
                for (let n = 0; n < 4; n += 1) {
                    const { conversationId, token: userToken } = await tenant.conversation(
                        `user-${n}`,
                    );
                    const seqs: number[] = [];
                    for (let turn = 0; turn < 2; turn += 1) {
                        const activity = await tenant.rest.postActivity(
                            userToken,
                            conversationId,
                            `turn ${turn}`,
                        );
                        seqs.push(activity.seq);
                    }
                    posted.set(conversationId, seqs);
                }
                await eventually(
                    async () => {
                        let total = 0;
                        for (const conversationId of posted.keys()) {
                            total += (await answers(tenant, conversationId)).length;
                        }
                        return total === 8;
                    },
                    { what: "eight answers", everyMs: 100 },
                );
            } finally {
                for (const agent of agents) {
                    agent.stop();
                }
                await Promise.all(runs);
            }
            for (const [conversationId, seqs] of posted) {
                const stored = await answers(tenant, conversationId);
                assert.deepEqual(
                    stored.map(answeredSeq).sort(),
                    [...seqs].sort(),
                    "one answer per turn",
                );
                assert.equal(answeredBy.get(conversationId)?.size, 1, "one owner per conversation");
            }
        },
    );

    test(
        "an answer whose ack was lost is resent after a reconnect and committed once",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const proxy = await new Proxy().start(mainNode().port);
            const agent = await startedAgent(proxy.url, await tenant.agentToken());
            const { conversationId, user } = await tenant.endUser();
            try {
                await user.sendText("hello");
                const turn = await nextTurn(agent);
                proxy.pause("downstream"); // the node's answers no longer reach the agent
                const replying = turn.reply(`#${turn.seq} once`);
                const answer = await nextMessage(user, fromBot); // committed
                assert.deepEqual(agent.unacked, [turn.clientId]);
                proxy.cut(); // the connection dies with the ack still in the proxy
                proxy.resume(); // the next connection reads again
                const ack = await replying;
                assert.equal(ack.duplicate, true);
                assert.deepEqual(ack.seqs, [answer.seq]);
                assert.equal(agent.connections, 2);
                assert.deepEqual(agent.unacked, []);
            } finally {
                await user.close();
                await agent.close();
                await proxy.close();
            }
            assert.deepEqual(
                (await answers(tenant, conversationId)).map((message) => message.text),
                ["#1 once"],
            );
        },
    );

    test("a send given up on (AckTimeout) ends every wait for its clientId", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        const proxy = await new Proxy().start(mainNode().port);
        const agent = await startedAgent(proxy.url, await tenant.agentToken());
        const { conversationId } = await tenant.conversation();
        try {
            proxy.pause("downstream"); // no ack reaches the agent
            const patient = agent.send(conversationId, "note", {
                clientId: "p-shared",
                timeoutMs: null,
            });
            const hasty = agent.send(conversationId, "note", {
                clientId: "p-shared",
                timeoutMs: 100,
            });
            await assert.rejects(bounded(hasty, "the timed-out send"), AckTimeout);
            await assert.rejects(bounded(patient, "the other wait"), AckTimeout);
            assert.deepEqual(agent.unacked, []);
        } finally {
            proxy.resume();
            await agent.close();
            await proxy.close();
        }
    });

    test(
        "turns sent while the agent was away are answered once after it reconnects",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const proxy = await new Proxy().start(mainNode().port);
            const agent = await startedAgent(proxy.url, await tenant.agentToken(), {
                WebSocket: TestSocket,
            });
            const sockets = TestSocket.made.length;
            const answered: number[] = [];
            const running = agent.run(async (turn) => {
                await turn.reply(`#${turn.seq} echo: ${turn.text}`);
                answered.push(turn.seq);
            });
            const { conversationId, token } = await tenant.conversation();
            try {
                const first = await tenant.rest.postActivity(token, conversationId, "before");
                await eventually(() => answered.length === 1, { what: "the first answer" });
                assert.deepEqual(agent.watermarks, { [conversationId]: first.seq });

                proxy.accepting = false;
                proxy.cut();
                await eventually(() => !agent.connected, { what: "the agent notices the cut" });
                const missed: number[] = [];
                for (let n = 0; n < 3; n += 1) {
                    missed.push(
                        (await tenant.rest.postActivity(token, conversationId, `while away ${n}`))
                            .seq,
                    );
                }
                proxy.accepting = true;
                await eventually(() => answered.length === 4, {
                    what: "the missed turns answered",
                });
                assert.ok(agent.connections >= 2);
                assert.deepEqual(answered.sort(), [first.seq, ...missed].sort());
                // the reconnect's hello named the conversation's watermark
                const hellos = TestSocket.made
                    .slice(sockets)
                    .map((socket) => parseObject(socket.sent[0] ?? "{}"));
                assert.deepEqual(hellos.at(-1)?.watermarks, { [conversationId]: first.seq });
            } finally {
                agent.stop();
                await running;
                await proxy.close();
            }
            const stored = await answers(tenant, conversationId);
            assert.equal(stored.length, 4, "each turn answered once");
        },
    );

    test(
        "an agent cut mid-stream gets StreamInterrupted, and its answer still commits after the reconnect",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const proxy = await new Proxy().start(mainNode().port);
            const agent = await startedAgent(proxy.url, await tenant.agentToken());
            const { conversationId, user } = await tenant.endUser();
            try {
                const updates = user.streamUpdates();
                await user.sendText("hi");
                const turn = await nextTurn(agent);
                const stream = turn.stream();
                await stream.write("Hel");
                await firstOf(updates, (update) => update.chunk?.index === 0);

                proxy.accepting = false;
                proxy.cut(); // the agent's connection dies mid-stream
                const ended = await firstOf(updates, (update) => update.end !== undefined);
                assert.deepEqual(
                    [ended.end?.status, ended.end?.reason],
                    ["aborted", "disconnected"],
                );
                await eventually(() => !agent.connected, { what: "the agent notices the cut" });
                await assert.rejects(stream.write("lo"), StreamInterrupted);
                proxy.accepting = true;
                await agent.waitConnected({ timeoutMs: WAIT_MS, connections: 2 });
                await assert.rejects(stream.write("lo"), StreamInterrupted); // not continued on a new connection
                assert.equal(stream.streamedText, "Hel");

                const ack = await stream.finish([{ type: "text", data: { text: "Hello" } }]);
                const answer = await nextMessage(user, fromBot);
                assert.equal(answer.text, "Hello");
                assert.deepEqual(ack.seqs, [answer.seq]);
            } finally {
                await user.close();
                await agent.close();
                await proxy.close();
            }
            assert.deepEqual(
                (await answers(tenant, conversationId)).map((message) => message.text),
                ["Hello"],
            );
        },
    );

    test("forwarded frames and end users' signals arrive as typed events", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        const agent = await startedAgent(tenant.url, await tenant.agentToken());
        const events = agent.events();
        const heard: AgentEvent[] = [];
        const unsubscribe = agent.on("event", (event) => heard.push(event));
        const { conversationId, user } = await tenant.endUser();
        try {
            const presence = await firstOf(events, (event) => event.kind === "presenceChange");
            assert.equal(presence.conversationId, conversationId);
            assert.equal(presence.kind === "presenceChange" && presence.status, "online");
            user.typing(true);
            const typing = await firstOf(events, (event) => event.kind === "userTyping");
            assert.equal(typing.kind === "userTyping" && typing.sender?.id, "alice");
            const resumeId = await user.resume({ interruptId: "int-1", answer: "yes" });
            const resume = await firstOf(events, (event) => event.kind === "forwarded");
            assert.ok(resume.kind === "forwarded");
            assert.deepEqual(
                [resume.type, resume.clientId, resume.data.answer],
                ["resume", resumeId, "yes"],
            );
            assert.ok(heard.some((event) => event.kind === "forwarded"));
            unsubscribe();
        } finally {
            await user.close();
            await agent.close();
        }
    });

    test("fatal closes are never reconnected", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        await assert.rejects(
            new Agent(tenant.url, "not-a-token", { group: "bot", logger: QUIET }).connect(),
            (error: unknown) => {
                assert.ok(error instanceof FatalClose);
                assert.equal(error.closeCode, 4401);
                return true;
            },
        );
        await assert.rejects(
            new Agent(tenant.url, await tenant.agentToken(), {
                group: "no spaces allowed",
                logger: QUIET,
            }).connect(),
            (error: unknown) => error instanceof FatalClose && error.closeCode === 4400,
        );
        assert.throws(() => new Agent(tenant.url, "t", { claim: "lease" }), /group/);

        const agent = await startedAgent(tenant.url, await tenant.agentToken());
        // The outcome is read at once: run() may end before the status change returns.
        const outcome = agent
            .run(async () => {
                throw new Error("no turn expected");
            })
            .then(
                () => undefined,
                (error: unknown) => error,
            );
        await tenant.rest.setChannelStatus(tenant.apiKey, tenant.channelId, "inactive");
        const stopped = await outcome;
        assert.ok(stopped instanceof FatalClose && stopped.closeCode === 4403, String(stopped));
        assert.equal(agent.failure, stopped);
        assert.equal(agent.connections, 1);
        // Stopped for good: connecting again meets the same refusal, so it is not tried.
        await assert.rejects(agent.connect(), (error: unknown) => error === stopped);
    });

    test(
        "close() during the handshake drops it at once: connect() rejects, no socket stays",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const proxy = await new Proxy().start(mainNode().port);
            try {
                proxy.pause("both"); // the upgrade gets no answer
                const agent = new Agent(proxy.url, await tenant.agentToken(), {
                    group: "bot",
                    logger: QUIET,
                    WebSocket: TestSocket,
                    // Far beyond WAIT_MS: only close() can end this handshake in time.
                    openTimeoutMs: 120_000,
                });
                const connecting = agent.connect();
                const socket = TestSocket.latest;
                if (socket === undefined) {
                    assert.fail("connect() made no socket");
                }
                assert.ok(socket.url.includes(String(proxy.port)));
                await eventually(() => proxy.accepted === 1, { what: "the upgrade started" });
                await bounded(agent.close({ timeoutMs: 0 }), "close()");
                await assert.rejects(bounded(connecting, "connect()"), ClientClosed);
                await eventually(() => socket.readyState === WebSocket.CLOSED, {
                    // Well before anything else would end it (the node drops a silent upgrade after 10 s).
                    timeoutMs: 2000,
                    what: "the handshake's socket closed",
                });
                assert.equal(agent.connected, false);
                assert.equal(agent.connections, 0);
            } finally {
                await proxy.close();
            }
        },
    );

    test(
        "lease mode: the fence travels with the answer, and a stale one is LeaseLost",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const token = await tenant.agentToken();
            const proxy = await new Proxy().start(mainNode().port);
            const firstHolder = await startedAgent(proxy.url, token, { claim: "lease" });
            const secondHolder = new Agent(tenant.url, token, {
                group: "bot",
                claim: "lease",
                backoff: FAST,
                logger: QUIET,
            });
            const { conversationId, token: userToken } = await tenant.conversation();
            try {
                assert.equal(firstHolder.welcome.claim, "lease");
                assert.ok((firstHolder.welcome.leaseMs ?? 0) > 0);
                await tenant.rest.postActivity(userToken, conversationId, "charge 10");
                const first = await nextTurn(firstHolder);
                assert.equal(first.fence, 1);
                assert.match(first.clientId, /-f1$/);

                // A second member joins; the first one's path dies mid-turn: its lease is released
                // with its socket and the takeover claims the turn for the second.
                await secondHolder.connect();
                proxy.accepting = false;
                proxy.cut();
                const taken = await nextTurn(secondHolder);
                assert.deepEqual([taken.key, taken.fence], [first.key, 2]);
                await taken.reply(`#${taken.seq} by the second holder`);

                proxy.accepting = true; // the first holder comes back and answers with its old fence
                await assert.rejects(
                    first.reply(`#${first.seq} by the first holder`),
                    (error: unknown) => {
                        assert.ok(error instanceof LeaseLost);
                        assert.equal(error.currentFence, 2);
                        return true;
                    },
                );
            } finally {
                await firstHolder.close();
                await secondHolder.close();
                await proxy.close();
            }
            assert.deepEqual(
                (await answers(tenant, conversationId)).map((message) => message.text),
                ["#1 by the second holder"],
            );
        },
    );
});

describe("agent, more flows", () => {
    test(
        "under the interrupt policy a newer turn cancels the running one (superseded)",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            await tenant.rest.setTurnSettings(tenant.apiKey, tenant.channelId, {
                turnPolicy: "enqueue",
                turnPolicyOverrides: ["interrupt"],
            });
            const agent = await startedAgent(tenant.url, await tenant.agentToken());
            const { conversationId, user } = await tenant.endUser();
            try {
                await user.sendText("first");
                const first = await nextTurn(agent);
                await user.sendText("second", { turnPolicy: "interrupt" });
                const second = await nextTurn(agent);
                assert.equal(second.text, "second");
                assert.equal(
                    await bounded(first.waitCancelled(), "the first turn's cancel"),
                    "superseded",
                );
                assert.ok(first.signal.reason instanceof TurnCancelled);
                assert.equal(second.cancelled, false);
                await second.reply("answered");
                const answer = await nextMessage(user, (message) => message.text === "answered");
                assert.equal(answer.from, "bot");
            } finally {
                await user.close();
                await agent.close();
            }
            const texts = (await answers(tenant, conversationId)).map((message) => message.text);
            assert.deepEqual(texts, ["answered"]);
        },
    );

    test("an observer gets no turns, every frame of the channel as an event", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        const observer = new Agent(tenant.url, await tenant.agentToken(), {
            backoff: FAST,
            logger: QUIET,
        });
        const welcome = await observer.connect();
        assert.equal(welcome.group, undefined);
        const events = observer.events();
        const { conversationId, token } = await tenant.conversation();
        try {
            const posted = await tenant.rest.postActivity(token, conversationId, "hello observers");
            const seen = await firstOf(events, (event) => event.kind === "message");
            assert.ok(seen.kind === "message");
            assert.deepEqual(
                [seen.conversationId, seen.message.seq, seen.message.text],
                [conversationId, posted.seq, "hello observers"],
            );
            assert.deepEqual(observer.watermarks, { [conversationId]: posted.seq });
        } finally {
            await observer.close();
        }
    });

    test(
        "an agent of a draining node reconnects to another node, no sooner than retryAfterMs",
        LIMIT,
        async () => {
            const draining = await startNode({}, { shareDatabaseOf: mainNode() });
            const tenant = await setupTenant(mainNode());
            const proxy = await new Proxy().start(draining.port);
            const agent = await startedAgent(proxy.url, await tenant.agentToken());
            const answered: number[] = [];
            const running = agent.run(async (turn) => {
                await turn.reply(`#${turn.seq} ${turn.text}`);
                answered.push(turn.seq);
            });
            try {
                // The node drains (SIGTERM); new connections reach the other node.
                proxy.retarget(mainNode().port);
                draining.process.kill("SIGTERM");
                await agent.waitConnected({ connections: 2, timeoutMs: WAIT_MS });
                assert.equal(proxy.accepted, 2);
                const closed = agent.lastDisconnect;
                assert.equal(closed?.code, 1012);
                const hint = closed?.retryAfterMs ?? 0;
                assert.ok(hint >= 50 && hint <= 100, `retryAfterMs ${hint}`);
                assert.ok(
                    (agent.connectedAt ?? 0) - (closed?.at ?? 0) >= hint,
                    "waited at least the hint",
                );

                await agent.waitEligible();
                const { conversationId, token } = await tenant.conversation();
                const posted = await tenant.rest.postActivity(
                    token,
                    conversationId,
                    "on the other node",
                );
                await eventually(() => answered.includes(posted.seq), {
                    what: "the answer from the other node",
                });
            } finally {
                agent.stop();
                await running;
                await proxy.close();
                await draining.stop();
            }
        },
    );
});

describe("agent over a rate-limited node", () => {
    const limited = withNode({ CONVERGER_LIMITS__MAX_FRAMES_PER_SEC: "4" });

    test(
        "proactive frames refused as rate_limited are resent after retryAfterMs and stored once",
        LIMIT,
        async () => {
            const tenant = await setupTenant(limited());
            const refusals: string[] = [];
            const agent = new Agent(tenant.url, await tenant.agentToken(), {
                backoff: FAST,
                logger: QUIET,
            });
            agent.on("error", (error) => refusals.push(error.code));
            await agent.connect();
            const { conversationId } = await tenant.conversation();
            try {
                const acks = await Promise.all(
                    Array.from({ length: 8 }, (_, n) =>
                        agent.send(conversationId, `burst ${n}`, { clientId: `b-${n}` }),
                    ),
                );
                assert.ok(refusals.includes("rate_limited"), `refusals: ${refusals.join(",")}`);
                assert.deepEqual(
                    acks.map((ack) => ack.seq).sort((a, b) => (a ?? 0) - (b ?? 0)),
                    [1, 2, 3, 4, 5, 6, 7, 8],
                );
            } finally {
                await agent.close();
            }
            const texts = (await tenant.frames(conversationId)).map((frame) => frame.text ?? "");
            assert.deepEqual(
                texts.sort(),
                Array.from({ length: 8 }, (_, n) => `burst ${n}`).sort(),
                "each frame stored once",
            );
        },
    );
});

describe("agent with short-lived tokens", () => {
    // The in-place renewal comes at 80 % of the token's life: with 6 s (exp in whole seconds),
    // the hook's mint and the auth frame have more than a second before the token expires.
    const shortLived = withNode({ CONVERGER_TOKEN_TTL_SECS: "6" });

    test(
        "the refreshToken hook renews the token on the open socket, and after an expiry close",
        LIMIT,
        async () => {
            const tenant = await setupTenant(shortLived());
            let calls = 0;
            const refreshed: number[] = [];
            const agent = new Agent(tenant.url, await tenant.agentToken(), {
                group: "bot",
                backoff: FAST,
                logger: {},
                refreshToken: async () => {
                    calls += 1;
                    if (calls === 1) {
                        // The first (early) renewal fails: the token expires, the node closes 4401,
                        // and the hook is asked again for the reconnect.
                        throw new Error("the token service is down");
                    }
                    return tenant.agentToken();
                },
            });
            agent.on("tokenRefreshed", () => refreshed.push(agent.connections));
            try {
                await agent.connect();
                await agent.waitConnected({ connections: 2, timeoutMs: WAIT_MS });
                assert.equal(agent.lastDisconnect?.code, 4401);
                // On the new connection the renewal happens in place: auth → tokenRefreshed.
                await eventually(() => refreshed.length >= 1, { what: "tokenRefreshed" });
                assert.deepEqual(refreshed.slice(0, 1), [2]);
                assert.equal(agent.connections, 2);
                assert.ok(calls >= 3, `${calls} hook calls`);
                await agent.waitEligible();
                const { conversationId, token } = await tenant.conversation();
                await tenant.rest.postActivity(token, conversationId, "still there?");
                const turn = await nextTurn(agent);
                await turn.reply("yes");
            } finally {
                await agent.close();
            }
        },
    );
});

describe("agent units", () => {
    test("an answer's clientId is derived from the turn (and its fence)", LIMIT, () => {
        const conversationId = "0193e0a4-1b2c-7d3e-8f40-123456789abc";
        assert.equal(
            resultClientId(conversationId, 18, 0, undefined),
            "result-0193e0a41b2c7d3e8f40123456789abc-18-0",
        );
        assert.equal(
            resultClientId(conversationId, 18, 2, 3),
            "result-0193e0a41b2c7d3e8f40123456789abc-18-2-f3",
        );
    });

    test("delivered frames that are not turns become typed events", LIMIT, () => {
        const conversationId = "c-1";
        const kinds = [
            { type: "resume", clientId: "r-1", data: { answer: "yes" } },
            { type: "typing", isTyping: true, sender: { id: "alice", role: "user" } },
            {
                type: "deliveryStatus",
                data: { upToSeq: 3, status: "read", by: { id: "alice", role: "user" } },
            },
            {
                type: "presence",
                data: {
                    participant: { id: "alice", role: "user" },
                    status: "online",
                    connections: 1,
                },
            },
            {
                type: "text",
                id: "m-1",
                seq: 4,
                from: "bot",
                sender: { id: "audit", role: "agent" },
                data: { text: "hi" },
            },
            { type: "conversationUpdate", data: { status: "closed" } },
        ].map((frame) => parseAgentEvent(conversationId, frame).kind);
        assert.deepEqual(kinds, [
            "forwarded",
            "userTyping",
            "readReceipt",
            "presenceChange",
            "message",
            "other",
        ]);
    });
});
