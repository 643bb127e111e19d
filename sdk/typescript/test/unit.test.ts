// Units without a node: tracking, stream assembly, backoff, wsUrl, error and frame parsing,
// the shared async queue and sleep.

import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { StreamAssembly } from "../src/assembly.js";
import { Backoff, LONGEST_SERVER_HINT_MS } from "../src/backoff.js";
import { retryHintOfReason, wsUrl } from "../src/connection.js";
import {
    AuthenticationError,
    FatalClose,
    InternalServerError,
    InvalidRequestError,
    LeaseLost,
    NotFoundError,
    restErrorClass,
    ServerError,
    ServiceUnavailableError,
    StaleRuntime,
    TurnConflict,
    TurnInProgress,
    TurnSuperseded,
} from "../src/errors.js";
import {
    parseAck,
    parseMessage,
    parseStreamChunk,
    parseStreamEnd,
    parseWelcome,
    type StreamChunk,
} from "../src/frames.js";
import { AsyncQueue, sleep } from "../src/internal.js";
import { isValidClientId } from "../src/shapes.js";
import { ChannelTracker, SeqTracker } from "../src/tracking.js";

describe("SeqTracker", () => {
    test("the watermark stays below a gap until it is filled", () => {
        const tracker = new SeqTracker(2);
        assert.equal(tracker.observe(2), false);
        assert.equal(tracker.observe(5), true);
        assert.equal(tracker.watermark, 2);
        assert.equal(tracker.hasGap, true);
        assert.equal(tracker.observe(5), false, "seen once");
        assert.equal(tracker.observe(3), true);
        assert.equal(tracker.observe(4), true);
        assert.equal(tracker.watermark, 5);
        assert.equal(tracker.hasGap, false);
        tracker.reset(1);
        assert.equal(tracker.watermark, 1);
        assert.equal(tracker.seen(2), false);
    });
});

describe("ChannelTracker", () => {
    test("turn deliveries are handed out once per revision, again under a newer fence", () => {
        const tracker = new ChannelTracker({ c1: 4 });
        assert.deepEqual(tracker.watermarks(), { c1: 4 });
        assert.equal(tracker.firstDelivery("c1", 3, 0), true);
        assert.equal(tracker.firstDelivery("c1", 3, 0), false);
        assert.equal(tracker.firstDelivery("c1", 3, 1), true, "a new revision");
        assert.equal(tracker.firstDelivery("c1", 3, 0), false, "an older revision");
        assert.equal(tracker.firstDelivery("c2", 1, 0, 1), true);
        assert.equal(tracker.firstDelivery("c2", 1, 0, 2), true, "a newer claim");
        assert.equal(tracker.firstDelivery("c2", 1, 0, 1), false);
        tracker.forgetDelivery("c1", 3, 1);
        assert.equal(tracker.firstDelivery("c1", 3, 1), true, "forgotten after a failure");
    });

    test("the least recently active conversations go first, watermarks newest first", () => {
        const tracker = new ChannelTracker({}, 2);
        tracker.observeSeq("a", 1);
        tracker.observeSeq("b", 2);
        tracker.observeSeq("a", 3);
        tracker.observeSeq("c", 4);
        assert.deepEqual(Object.keys(tracker.watermarks()), ["c", "a"]);
        assert.deepEqual(tracker.watermarks(1), { c: 4 });
    });
});

function chunk(fields: Record<string, unknown>): StreamChunk {
    const parsed = parseStreamChunk({ type: "streamChunk", streamId: "s1", ...fields });
    assert.ok(parsed !== undefined);
    return parsed;
}

describe("StreamAssembly", () => {
    test("each chunk is applied once, coalesced catch-up chunks add only what is new", () => {
        const assembly = new StreamAssembly();
        assert.ok(
            assembly.applyChunk(chunk({ index: 0, text: "Hel", turn: { seq: 1, revision: 0 } })),
        );
        assert.ok(assembly.applyChunk(chunk({ index: 1, text: "lo" })));
        assert.equal(assembly.applyChunk(chunk({ index: 1, text: "lo" })), undefined, "a repeat");
        assert.equal(assembly.applyChunk(chunk({ index: 3, text: "!" })), undefined, "a gap");
        // A reconnect shows the stream again, coalesced: indexes 0..2 in one chunk.
        const stream = assembly.applyChunk(chunk({ firstIndex: 0, index: 2, text: "Hello, w" }));
        assert.ok(stream);
        assert.equal(stream.text, "Hello, w");
        assert.equal(stream.nextIndex, 3);
        assert.equal(stream.turn?.seq, 1);
        assert.ok(stream.duplicates >= 2);
        assert.ok(assembly.applyChunk(chunk({ index: 3, text: "orld" })));
        assert.equal(assembly.get("s1")?.text, "Hello, world");
    });

    test("a stream ends once, from its streamEnd or from the stored answer naming it", () => {
        const assembly = new StreamAssembly();
        assembly.applyChunk(chunk({ index: 0, text: "a" }));
        const answer = parseMessage({
            type: "text",
            id: "s1",
            seq: 2,
            from: "bot",
            data: { text: "a" },
            streamId: "s1",
        });
        assert.ok(answer);
        const ended = assembly.applyMessage(answer);
        assert.equal(ended?.end.status, "committed");
        assert.equal(assembly.get("s1")?.committed, true);
        const end = parseStreamEnd({ type: "streamEnd", streamId: "s1", status: "committed" });
        assert.ok(end);
        assert.equal(assembly.applyEnd(end), undefined, "ended already");
        assert.equal(assembly.applyChunk(chunk({ index: 1, text: "late" })), undefined);
        assert.deepEqual(assembly.open, []);
    });

    test("an end before any chunk is recorded, and later chunks are dropped", () => {
        const assembly = new StreamAssembly();
        const end = parseStreamEnd({
            type: "streamEnd",
            streamId: "s1",
            status: "aborted",
            reason: "stopped",
        });
        assert.ok(end);
        assert.equal(assembly.applyEnd(end), undefined);
        assert.equal(assembly.applyChunk(chunk({ index: 0, text: "x" })), undefined);
        assert.equal(assembly.get("s1")?.reason, "stopped");
    });
});

describe("Backoff", () => {
    test("full jitter under an exponential ceiling, floored by the server's hint", () => {
        const backoff = new Backoff({ initialMs: 100, maximumMs: 1000, maxAttempts: 3 });
        assert.equal(backoff.ceiling(0), 100);
        assert.equal(backoff.ceiling(3), 800);
        assert.equal(backoff.ceiling(10), 1000);
        assert.equal(
            backoff.delay(2, undefined, () => 0.5),
            200,
        );
        assert.equal(
            backoff.delay(0, 700, () => 0),
            700,
        );
        assert.equal(
            backoff.delay(0, 10_000_000, () => 0),
            LONGEST_SERVER_HINT_MS,
        );
        assert.equal(backoff.exhausted(2), false);
        assert.equal(backoff.exhausted(3), true);
        assert.equal(new Backoff().exhausted(1000), false);
        for (let attempt = 0; attempt < 20; attempt += 1) {
            const delay = backoff.delay(attempt);
            assert.ok(delay >= 0 && delay <= backoff.ceiling(attempt));
        }
    });
});

describe("wsUrl", () => {
    test("http bases become the socket endpoint; given paths are kept", () => {
        assert.equal(wsUrl("http://127.0.0.1:8080"), "ws://127.0.0.1:8080/socket/converger/v1");
        assert.equal(wsUrl("https://example.test/"), "wss://example.test/socket/converger/v1");
        assert.equal(wsUrl("ws://h:1"), "ws://h:1/socket/converger/v1");
        assert.equal(wsUrl("wss://h/custom?x=1"), "wss://h/custom?x=1");
        assert.equal(wsUrl("http://h:1/?a=b"), "ws://h:1/socket/converger/v1?a=b");
    });

    test("close reasons carry retryAfterMs as JSON", () => {
        assert.equal(retryHintOfReason('{"reason":"unavailable","retryAfterMs":1500}'), 1500);
        assert.equal(retryHintOfReason("rate_limited:retry_after_ms=250"), 250);
        assert.equal(retryHintOfReason("idle"), undefined);
        assert.equal(retryHintOfReason("{not json"), undefined);
    });
});

describe("errors", () => {
    test("ServerError.fromData picks the subclass of the code", () => {
        const conflict = ServerError.fromData({
            code: "turn_conflict",
            message: "m",
            details: { seqs: [4, 5] },
        });
        assert.ok(conflict instanceof TurnConflict);
        assert.deepEqual(conflict.committedSeqs, [4, 5]);
        const superseded = ServerError.fromData({
            code: "turn_superseded",
            details: { revision: 2 },
        });
        assert.ok(superseded instanceof TurnSuperseded && superseded.latestRevision === 2);
        const stale = ServerError.fromData({ code: "stale_runtime", details: { version: 7 } });
        assert.ok(stale instanceof StaleRuntime && stale.currentVersion === 7);
        const lost = ServerError.fromData({ code: "lease_lost", details: { fence: 3 } });
        assert.ok(lost instanceof LeaseLost && lost.currentFence === 3);
        const busy = ServerError.fromData({
            code: "turn_in_progress",
            details: { turn: { seq: 9 } },
        });
        assert.ok(busy instanceof TurnInProgress && busy.runningSeq === 9);
        const limited = ServerError.fromData({
            code: "rate_limited",
            number: 3001,
            retryable: true,
            retryAfterMs: 40,
            clientId: "c-1",
        });
        assert.equal(limited.constructor, ServerError);
        assert.equal(limited.retryable, true);
        assert.equal(limited.retryAfterMs, 40);
        assert.equal(limited.clientId, "c-1");
        assert.equal(ServerError.fromData("nonsense").code, "unknown");
    });

    test("FatalClose knows an expired token", () => {
        const refusal = ServerError.fromData({
            code: "unauthorized",
            details: { reason: "token_expired" },
        });
        assert.equal(new FatalClose(4401, "", refusal).tokenExpired, true);
        assert.equal(new FatalClose(4401, "token_expired").tokenExpired, true);
        assert.equal(new FatalClose(4401, "unauthorized").tokenExpired, false);
        assert.equal(new FatalClose(undefined, "", undefined, 404).httpStatus, 404);
    });

    test("REST errors by status", () => {
        assert.equal(restErrorClass(400), InvalidRequestError);
        assert.equal(restErrorClass(401), AuthenticationError);
        assert.equal(restErrorClass(404), NotFoundError);
        assert.equal(restErrorClass(500), InternalServerError);
        assert.equal(restErrorClass(503), ServiceUnavailableError);
    });
});

describe("frames", () => {
    test("persistent frames, acks and welcomes parse; control types are not messages", () => {
        assert.equal(parseMessage({ type: "ack", seq: 3 }), undefined);
        assert.equal(parseMessage({ type: "text" }), undefined);
        const message = parseMessage({
            type: "text",
            id: "a",
            seq: 3,
            from: "user",
            sender: { id: "alice", role: "user" },
            data: { text: "hi" },
            clientId: "c-1",
        });
        assert.equal(message?.text, "hi");
        assert.equal(message?.sender?.id, "alice");
        const ack = parseAck({
            type: "ack",
            clientId: "s-1",
            stopped: true,
            turn: { seq: 2, revision: 1 },
        });
        assert.equal(ack.stopped, true);
        assert.deepEqual(ack.turn, { seq: 2, revision: 1 });
        const welcome = parseWelcome({
            scope: "conversation",
            limits: { maxInFlight: 4 },
            capabilities: { streams: true },
        });
        assert.equal(welcome.limits.maxInFlight, 4);
        assert.equal(welcome.limits.maxFrameBytes, 65536);
        assert.equal(welcome.streams, true);
        assert.equal(parseStreamChunk({ streamId: "s", index: 1, firstIndex: 2 }), undefined);
    });

    test("clientIds have the protocol's shape", () => {
        assert.ok(isValidClientId("c-1.a:b~_"));
        assert.ok(!isValidClientId(""));
        assert.ok(!isValidClientId("a b"));
        assert.ok(!isValidClientId("x".repeat(129)));
    });
});

describe("AsyncQueue", () => {
    test("a timed-out read is withdrawn: the next item goes to the next read", async () => {
        const queue = new AsyncQueue<number>();
        assert.equal(await queue.nextWithin(5), "timeout");
        queue.push(1);
        assert.deepEqual(await queue.nextWithin(1000), { value: 1, done: false });
    });

    test("a bounded queue drops its oldest unread item; a closed one ends after what is queued", async () => {
        const queue = new AsyncQueue<number>(2);
        queue.push(1);
        queue.push(2);
        queue.push(3);
        queue.close();
        queue.push(4);
        assert.deepEqual(await queue.next(), { value: 2, done: false });
        assert.deepEqual(await queue.next(), { value: 3, done: false });
        assert.deepEqual(await queue.next(), { value: undefined, done: true });
    });

    test("closing with an error rejects the pending and later reads", async () => {
        const queue = new AsyncQueue<number>();
        const pending = queue.next();
        queue.close(new Error("stopped"));
        await assert.rejects(pending, /stopped/);
        await assert.rejects(queue.next(), /stopped/);
    });
});

describe("sleep", () => {
    test("an abort ends it at once", async () => {
        const lifetime = new AbortController();
        const started = Date.now();
        const sleeping = sleep(60_000, lifetime.signal);
        lifetime.abort();
        await sleeping;
        assert.ok(Date.now() - started < 1000);
        await sleep(60_000, lifetime.signal); // already aborted: returns at once
    });
});
