// Conversations against a real node: acks, answers seen once, resends after lost acks, replays
// after reconnects, streamed answers across reconnects, the other signals, token renewal.

import assert from "node:assert/strict";
import { afterEach, describe, test } from "node:test";
import { WebSocket } from "ws";
import type { StreamUpdate } from "../src/assembly.js";
import type { ConnectionState } from "../src/conversation.js";
import { Conversation } from "../src/conversation.js";
import { ClientClosed, FatalClose, GaveUp } from "../src/errors.js";
import type { ConversationEvent, Message } from "../src/frames.js";
import { asObject } from "../src/json.js";
import {
    eventually,
    FAST,
    LIMIT,
    Proxy,
    RawAgent,
    setupTenant,
    type Tenant,
    turnOf,
    WAIT_MS,
    withNode,
} from "./support.js";

const mainNode = withNode();
const cleanups: Array<() => Promise<void>> = [];

afterEach(async () => {
    for (const cleanup of cleanups.splice(0).reverse()) {
        await cleanup().catch(() => {});
    }
});

async function agentFor(tenant: Tenant): Promise<RawAgent> {
    const agent = await RawAgent.connect(tenant.url, await tenant.agentToken());
    cleanups.push(() => agent.close());
    return agent;
}

async function userOf(tenant: Tenant, url = tenant.url): Promise<Conversation> {
    const { user } = await tenant.endUser({ url });
    cleanups.push(() => user.close({ timeoutMs: 0 }));
    return user;
}

async function proxyFor(): Promise<Proxy> {
    const proxy = await new Proxy().start(mainNode().port);
    cleanups.push(() => proxy.close());
    return proxy;
}

function record<T>(subscribe: (handler: (item: T) => void) => () => void): T[] {
    const items: T[] = [];
    const stop = subscribe((item) => items.push(item));
    cleanups.push(async () => stop());
    return items;
}

/** The `ws` socket, recording every socket made (to see whether one outlives its client). */
class RecordedSocket extends WebSocket {
    static made: RecordedSocket[] = [];

    constructor(url: string, protocols?: string | string[]) {
        super(url, protocols);
        RecordedSocket.made.push(this);
    }
}

function seqsOf(messages: Message[]): number[] {
    return messages.map((message) => message.seq);
}

describe("Conversation", () => {
    test(
        "a send is acked with its seq and the agent's answer is a message, once",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const agent = await agentFor(tenant);
            const user = await userOf(tenant);
            assert.equal(user.connected, true);
            assert.equal(user.connections, 1);
            assert.ok(user.conversationId);
            assert.equal(user.userId, "alice");

            const ack = await user.sendText("hello", { clientId: "c-hello" });
            assert.equal(ack.clientId, "c-hello");
            assert.equal(ack.seq, 1);
            assert.equal(ack.duplicate, false);
            assert.deepEqual(user.unacked, []);

            const turn = await agent.nextTurn(user.conversationId);
            assert.equal(turn.message.text, "hello");
            agent.reply(turn.conversationId, turn.message, "hi alice");
            const answer = await user.nextMessage({ timeoutMs: WAIT_MS });
            assert.equal(answer.text, "hi alice");
            assert.equal(answer.from, "bot");
            assert.equal(answer.seq, 2);
            assert.equal(user.watermark, 2);
            // The same clientId again is the same send: acked as a duplicate, stored once.
            const again = await user.sendText("hello", { clientId: "c-hello" });
            assert.equal(again.duplicate, true);
            assert.equal(again.seq, 1);
            const stored = await tenant.frames(user.conversationId ?? "");
            assert.deepEqual(seqsOf(stored), [1, 2]);
        },
    );

    test(
        "a send whose ack was lost is resent under its clientId and stored once",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const proxy = await proxyFor();
            const user = await userOf(tenant, proxy.url);
            const acks = record((handler) => user.on("ack", handler));
            proxy.pause("downstream"); // the node's answers no longer reach the user
            const sending = user.sendText("only once", { clientId: "c-once" });
            await eventually(
                async () => (await tenant.frames(user.conversationId ?? "")).length === 1,
                { what: "the send stored" },
            );
            assert.deepEqual(user.unacked, ["c-once"]);
            proxy.cut(); // the connection dies with the ack still in the proxy
            proxy.resume();
            const ack = await sending;
            assert.equal(ack.seq, 1);
            assert.equal(ack.duplicate, true);
            assert.ok(user.connections >= 2);
            assert.deepEqual(user.unacked, []);
            assert.equal(acks.length, 1);
            const stored = await tenant.frames(user.conversationId ?? "");
            assert.deepEqual(
                stored.map((frame) => frame.text),
                ["only once"],
            );
            assert.ok(user.lastDisconnect !== undefined);

            // A send given up with its AbortSignal is no longer resent and rejects at once.
            proxy.pause("both");
            const giveUp = new AbortController();
            const abandoned = user.sendText("never mind", {
                clientId: "c-abandoned",
                signal: giveUp.signal,
            });
            assert.deepEqual(user.unacked, ["c-abandoned"]);
            giveUp.abort(new Error("the user navigated away"));
            await assert.rejects(abandoned, /navigated away/);
            assert.deepEqual(user.unacked, []);
            proxy.resume();
        },
    );

    test(
        "after a reconnect the replay starts at the watermark: no message twice",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const proxy = await proxyFor();
            const agent = await agentFor(tenant);
            const { conversationId, token } = await tenant.conversation("alice");
            const user = new Conversation(proxy.url, token, { backoff: FAST });
            cleanups.push(() => user.close({ timeoutMs: 0 }));
            const messages = record<Message>((handler) => user.on("message", handler));
            const states = record<ConnectionState>((handler) => user.on("state", handler));
            await user.connect();

            await user.sendText("one");
            const first = await agent.nextTurn(conversationId);
            agent.reply(conversationId, first.message, "answer one");
            await eventually(() => messages.length === 1, { what: "the first answer" });

            proxy.accepting = false;
            proxy.cut();
            await eventually(() => !user.connected, { what: "the disconnect" });
            // While the user is away: another turn over REST, and its answer.
            await tenant.rest.postActivity(token, conversationId, "two");
            const second = await agent.nextTurn(conversationId);
            agent.reply(conversationId, second.message, "answer two");
            await eventually(async () => (await tenant.frames(conversationId)).length === 4, {
                what: "4 stored",
            });
            proxy.accepting = true;
            await user.waitConnected({ connections: 2, timeoutMs: WAIT_MS });
            await eventually(() => messages.length === 3, { what: "the replayed frames" });
            assert.deepEqual(seqsOf(messages), [2, 3, 4]);
            assert.deepEqual(
                messages.map((message) => message.text),
                ["answer one", "two", "answer two"],
            );
            assert.equal(user.watermark, 4);
            assert.ok(states.some((state) => !state.connected));
            assert.equal(states.at(-1)?.connected, true);
        },
    );

    test(
        "a streamed answer is assembled once across a reconnect and ends with its stored answer",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const proxy = await proxyFor();
            const agent = await agentFor(tenant);
            const user = await userOf(tenant, proxy.url);
            const conversationId = user.conversationId ?? "";
            const updates = record<StreamUpdate>((handler) => user.on("streamUpdate", handler));
            await user.sendText("tell me");
            const turn = await agent.nextTurn(conversationId);
            const chunk = (index: number, text: string): void => {
                const frame: Record<string, unknown> = {
                    type: "streamChunk",
                    streamId: "story-1",
                    index,
                    text,
                };
                if (index === 0) {
                    frame.turn = { seq: turn.message.seq, revision: 0 };
                }
                agent.sendEnveloped(conversationId, frame);
            };
            chunk(0, "Once ");
            chunk(1, "upon ");
            await eventually(() => user.streams.get("story-1")?.text === "Once upon ", {
                what: "two chunks",
            });

            proxy.accepting = false;
            proxy.cut();
            await eventually(() => !user.connected, { what: "the disconnect" });
            chunk(2, "a time");
            proxy.accepting = true;
            await user.waitConnected({ connections: 2, timeoutMs: WAIT_MS });
            // The new connection is shown the open stream again, coalesced; only "a time" is new.
            await eventually(() => user.streams.get("story-1")?.text === "Once upon a time", {
                what: "the catch-up",
            });
            agent.sendEnveloped(conversationId, {
                type: "turnResult",
                clientId: "r-story",
                turn: { seq: turn.message.seq, revision: 0 },
                frames: [{ type: "text", data: { text: "Once upon a time" }, streamId: "story-1" }],
            });
            const answer = await user.nextMessage({ timeoutMs: WAIT_MS });
            assert.equal(answer.text, "Once upon a time");
            await eventually(() => updates.some((update) => update.end !== undefined), {
                what: "the end",
            });
            const stream = user.streams.get("story-1");
            assert.ok(stream);
            assert.equal(stream.committed, true);
            assert.equal(stream.text, "Once upon a time");
            // Counted as 2 when the node took chunk 2 (another socket) before the catch-up, which
            // then covered 0 to 2, else as 1 (it covered 0 and 1, and chunk 2 came live).
            assert.ok([1, 2].includes(stream.duplicates), "the chunks shown again were dropped");
            const chunkUpdates = updates.filter((update) => update.chunk !== undefined);
            assert.equal(chunkUpdates.length, 3, "one update per new chunk");
            assert.equal(updates.filter((update) => update.end !== undefined).length, 1, "one end");
            // The stored answer names the stream: it is a message too, once.
            const stored = await tenant.frames(conversationId);
            assert.equal(stored.filter((frame) => frame.text === "Once upon a time").length, 1);
        },
    );

    test(
        "typing, read receipts, presence, edit, regenerate and stop reach the agents",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const agent = await agentFor(tenant);
            const user = await userOf(tenant);
            const conversationId = user.conversationId ?? "";
            const inner = (type: string) => (frame: Record<string, unknown>) =>
                frame.conversationId === conversationId && asObject(frame.frame).type === type;

            const presence = asObject((await agent.next(inner("presence"))).frame);
            assert.equal(asObject(presence.data).status, "online");
            assert.equal(user.typing(true), true);
            const typing = asObject((await agent.next(inner("typing"))).frame);
            assert.equal(typing.isTyping, true);
            assert.equal(asObject(typing.sender).id, "alice");

            await user.sendText("first");
            const turn = await agent.nextTurn(conversationId);
            assert.equal(user.read(1), true);
            const receipt = asObject((await agent.next(inner("deliveryStatus"))).frame);
            assert.equal(asObject(receipt.data).upToSeq, 1);

            const edited = await user.edit("first, edited", { seq: turn.message.seq });
            assert.deepEqual(edited.turn, { seq: 1, revision: 1 });
            const revised = await agent.nextTurn(conversationId);
            assert.equal(revised.message.replaces, 1, "the edit is a frame of its own");
            assert.equal(revised.message.text, "first, edited");
            assert.deepEqual(turnOf(revised.message), { seq: 1, revision: 1 });

            const regenerated = await user.regenerate({ seq: 1 });
            assert.deepEqual(regenerated.turn, { seq: 1, revision: 2 });
            const again = await agent.nextTurn(conversationId);
            assert.deepEqual(turnOf(again.message), { seq: 1, revision: 2 });

            const stopped = await user.stop({ seq: 1 });
            assert.equal(stopped.stopped, true);
            assert.equal(stopped.turn?.seq, 1);
            const cancel = asObject((await agent.next(inner("cancel"))).frame);
            assert.equal(cancel.reason, "stopped");

            // And back: the agent's typing reaches the user as an event.
            const events: ConversationEvent[] = record((handler) => user.on("event", handler));
            agent.sendEnveloped(conversationId, { type: "typing", isTyping: true });
            await eventually(
                () => events.some((event) => event.kind === "typing" && event.isTyping),
                {
                    what: "the agent typing",
                },
            );
            const forwarded = await user.abort({ why: "enough" });
            const abort = asObject((await agent.next(inner("abort"))).frame);
            assert.equal(abort.clientId, forwarded);
        },
    );

    test(
        "a refused hello is a FatalClose, never reconnected; GaveUp when nothing answers",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const refused = new Conversation(tenant.url, "not-a-token", { backoff: FAST });
            await assert.rejects(refused.connect(), (error: unknown) => {
                assert.ok(error instanceof FatalClose);
                assert.equal(error.closeCode, 4401);
                assert.equal(error.refusal?.code, "unauthorized");
                return true;
            });
            assert.equal(refused.connections, 0);
            const proxy = await proxyFor();
            proxy.accepting = false;
            const { token } = await tenant.conversation("alice");
            const unreachable = new Conversation(proxy.url, token, {
                backoff: FAST,
                openTimeoutMs: 2000,
            });
            await assert.rejects(unreachable.connect(), GaveUp);
            // A forwarded frame without a connected agent is answered bot_unavailable, as an event.
            const user = await userOf(tenant);
            const events = record<ConversationEvent>((handler) => user.on("event", handler));
            const clientId = await user.resume({ answer: "yes" });
            await eventually(
                () =>
                    events.some(
                        (event) =>
                            event.kind === "error" &&
                            event.error.code === "bot_unavailable" &&
                            event.error.clientId === clientId,
                    ),
                { what: "bot_unavailable" },
            );
        },
    );

    test("messages() yields each persistent frame once and ends when closed", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        const agent = await agentFor(tenant);
        const user = await userOf(tenant);
        const conversationId = user.conversationId ?? "";
        await user.sendText("q");
        const turn = await agent.nextTurn(conversationId);
        agent.reply(conversationId, turn.message, "a");
        const seen: Message[] = [];
        const reading = (async () => {
            for await (const message of user.messages()) {
                seen.push(message);
            }
        })();
        await eventually(() => seen.length === 1, { what: "the answer" });
        await user.close();
        await reading;
        assert.deepEqual(
            seen.map((message) => message.text),
            ["a"],
        );
        await assert.rejects(user.sendText("late"), { name: "ClientClosed" });
    });

    test(
        "close() during a reconnect ends it at once: waiters throw, no handshake outlives it",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const proxy = await proxyFor();
            const { token } = await tenant.conversation("alice");
            const user = new Conversation(proxy.url, token, {
                backoff: FAST,
                WebSocket: RecordedSocket,
                // Far beyond WAIT_MS: only close() can end the reconnect's handshake in time.
                openTimeoutMs: 120_000,
            });
            cleanups.push(() => user.close({ timeoutMs: 0 }));
            await user.connect();
            const first = RecordedSocket.made.length;
            proxy.pause("both"); // the reconnect's upgrade gets no answer
            proxy.cut();
            await eventually(() => RecordedSocket.made.length === first + 1, {
                what: "a reconnect attempt",
            });
            const attempt = RecordedSocket.made.at(-1);
            assert.ok(attempt !== undefined);
            assert.equal(user.connected, false);
            const waiting = user.waitConnected({ connections: 2, timeoutMs: 120_000 });
            await user.close({ timeoutMs: 0 });
            await assert.rejects(waiting, ClientClosed);
            await eventually(() => attempt.readyState === WebSocket.CLOSED, {
                // Well before anything else would end it (the node drops a silent upgrade after 10 s).
                timeoutMs: 2000,
                what: "the reconnect's socket closed",
            });
            assert.equal(RecordedSocket.made.length, first + 1);
            assert.equal(user.connections, 1);
        },
    );
});

describe("token renewal", () => {
    // Long enough that the reconnected socket's token outlives a send, a mint and the renewal
    // on a loaded machine (exp is in whole seconds).
    const shortLived = withNode({ CONVERGER_TOKEN_TTL_SECS: "5" });

    test(
        "an expired token is renewed through refreshToken and the conversation goes on",
        LIMIT,
        async () => {
            const tenant = await setupTenant(shortLived());
            const { conversationId, token } = await tenant.conversation("alice");
            let renewals = 0;
            const user = new Conversation(tenant.url, token, {
                backoff: FAST,
                refreshToken: async () => {
                    renewals += 1;
                    const issued = await tenant.rest.generateToken(tenant.channelSecret, {
                        userId: "alice",
                        conversationId,
                    });
                    return issued.token;
                },
            });
            cleanups.push(() => user.close({ timeoutMs: 0 }));
            const events = record<ConversationEvent>((handler) => user.on("event", handler));
            await user.connect();
            await user.sendText("before");
            // At the token's exp the node says token_expired and closes 4401: renewed, reconnected.
            await user.waitConnected({ connections: 2, timeoutMs: WAIT_MS });
            assert.ok(renewals >= 1);
            assert.equal(user.lastDisconnect?.code, 4401);
            assert.ok(
                events.some(
                    (event) => event.kind === "error" && event.error.code === "token_expired",
                ),
            );
            const ack = await user.sendText("after");
            assert.equal(ack.seq, 2);
            // A token handed over in time is accepted in place (`auth` → tokenRefreshed).
            const fresh = await tenant.rest.generateToken(tenant.channelSecret, {
                userId: "alice",
                conversationId,
            });
            assert.equal(user.refreshToken(fresh.token), true);
            await eventually(() => events.some((event) => event.kind === "tokenRefreshed"), {
                what: "tokenRefreshed",
            });
        },
    );
});
