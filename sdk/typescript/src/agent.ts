// Agents: a channel-scope connection in a group, typed turns, and answers resent until acked.
//
// An Agent holds one WebSocket to a node and serves the conversations of one channel
// (docs/agents.md, docs/protocol.md §4). It reconnects by itself (full-jitter backoff, honouring
// the server's `retryAfterMs`; never after 4400, 4401, 4403 or 1009), asks for what it missed
// with `hello.watermarks`, resends every unacknowledged answer with the same clientId after a
// reconnect, and hands each turn delivery to the application once.
//
//     const agent = new Agent("http://127.0.0.1:8080", token, { group: "echo" });
//     await agent.run(async (turn) => {
//         await turn.reply(`echo: ${turn.text}`);
//     }, { concurrency: 4 });
//
// or, iterator style:
//
//     await agent.connect();
//     for await (const turn of agent.turns()) await turn.reply(`echo: ${turn.text}`);

import {
    type AnswerOptions,
    AnswerStream,
    type StreamedTurn,
    type StreamHost,
} from "./answer-stream.js";
import { Backoff } from "./backoff.js";
import {
    type CloseInfo,
    type Connection,
    DEFAULT_OPEN_TIMEOUT_MS,
    type Disconnect,
    disconnectOf,
    FATAL_CLOSE_CODES,
    type OpenedSession,
    openSession,
    silenceLimitMs,
    type WebSocketConstructor,
    wsUrl,
} from "./connection.js";
import {
    AckTimeout,
    ClientClosed,
    ConnectFailed,
    ConvergerError,
    DEFAULT_RETRY_AFTER_MS,
    FatalClose,
    FrameTooLarge,
    GaveUp,
    LeaseLost,
    RESENT_CODES,
    ServerError,
    StaleRuntime,
    StreamClosed,
    StreamInterrupted,
    TurnConflict,
    TurnStopped,
    TurnSuperseded,
} from "./errors.js";
import {
    type Ack,
    type ForwardedType,
    isForwardedType,
    type Message,
    type Participant,
    parseAck,
    parseMessage,
    parseParticipant,
    parseReplyAck,
    parseRuntime,
    parseWelcome,
    type ReplyAck,
    type Runtime,
    type Welcome,
} from "./frames.js";
import {
    AsyncQueue,
    ChangeSignal,
    delay,
    Listeners,
    resultClientId,
    Semaphore,
    sleep,
    touch,
    waitUntil,
    within,
} from "./internal.js";
import {
    asInt,
    asObject,
    asString,
    byteLength,
    isObject,
    type JsonObject,
    stringify,
} from "./json.js";
import { type FrameLike, framesOf, isValidClientId, randomHex } from "./shapes.js";
import { ChannelTracker, REMEMBERED_CONVERSATIONS } from "./tracking.js";

/** Delivered turns a `cancel` can still reach: the most recent ones. */
const CANCELLABLE_TURNS = 4096;
/** The `frameType` of the refusals that concern a stream (routed to the stream). */
const STREAM_FRAME_TYPES: ReadonlySet<string> = new Set(["streamChunk", "streamAbort"]);
/** A write waits while the socket buffers more than this many bytes (flow control). */
const SEND_BUFFER_HIGH_WATER = 1 << 20;
/** How often a write that waits for the buffer checks it again. */
const SEND_BUFFER_POLL_MS = 10;
/** A write never waits longer than this for the buffer to drain (the socket is then dead). */
const SEND_BUFFER_WAIT_MS = 30_000;
/** The `maxFrameBytes` assumed before the first welcome (the hello must fit under it). */
const HELLO_FRAME_BYTES = 16384;
/** How long the token refresh hook may take. */
const REFRESH_HOOK_TIMEOUT_MS = 30_000;
/**
 * The longest delay a timer takes (2^31 - 1 ms, about 24.8 days): a longer one fires at once, which
 * for the token refresh would refresh, reschedule and refresh again without pause.
 */
const LONGEST_TIMER_MS = 2_147_483_647;
/** How often the silence is checked. */
const WATCHDOG_TICK_MS = 1000;

/** Where the agent reports what it does; each method is optional. */
export interface AgentLogger {
    debug?(message: string): void;
    info?(message: string): void;
    warn?(message: string): void;
    error?(message: string): void;
}

/** By default only warnings and errors are reported, on the console. */
const CONSOLE_LOGGER: AgentLogger = {
    warn: (message) => console.warn(`converger agent: ${message}`),
    error: (message) => console.error(`converger agent: ${message}`),
};

export interface AgentOptions {
    /** The group to join; absent: an observer (no turns, every frame as an event). */
    group?: string;
    /**
     * `"lease"` asks for lease mode (`hello.claim`, needs a `group`): each turn comes with a fence
     * that the answer carries back, and a stale one is refused with {@link LeaseLost}.
     */
    claim?: "lease";
    /** Per conversation, the highest seq already seen (sent in `hello.watermarks`). */
    watermarks?: Record<string, number>;
    /** Paces reconnects (default: 0.5 s doubling up to 30 s, full jitter, forever). */
    backoff?: Backoff;
    /** Bound of each upgrade and of each wait for `welcome`, in ms (default 10 000). */
    openTimeoutMs?: number;
    /** The wait before an unacked frame is sent again on the same connection, in ms (default 5000). */
    resendIntervalMs?: number;
    /** Caps the conversations named in `hello.watermarks` (the most recently active; default 500). */
    helloWatermarks?: number;
    /** The WebSocket constructor (default: the platform's, else the `ws` package). */
    WebSocket?: WebSocketConstructor;
    /**
     * Called for a fresh token: shortly before the current one expires (then sent as `auth` on the
     * open socket) and when the node closed the connection because it expired (then used by the
     * reconnect). Without it an expired token ends the agent with {@link FatalClose}.
     */
    refreshToken?: () => Promise<string> | string;
    /** Where to report what happens (default: warnings and errors on the console). */
    logger?: AgentLogger;
}

// --- Events: what an agent receives besides turns ------------------------------------------

interface AgentEventBase {
    readonly conversationId: string;
    /** The delivered frame. */
    readonly frame: JsonObject;
}

/** A client frame an end user sent for the agents (`resume`, `abort`, …), handed over as sent. */
export interface ForwardedFrame extends AgentEventBase {
    readonly kind: "forwarded";
    readonly type: ForwardedType;
    readonly clientId: string | undefined;
    readonly data: JsonObject;
}

/** An end user's `typing`. */
export interface UserTyping extends AgentEventBase {
    readonly kind: "userTyping";
    readonly isTyping: boolean;
    readonly sender: Participant | undefined;
}

/** A `deliveryStatus`: `by` has read up to `upToSeq`. */
export interface ReadReceipt extends AgentEventBase {
    readonly kind: "readReceipt";
    readonly upToSeq: number | undefined;
    readonly status: string | undefined;
    readonly by: Participant | undefined;
}

/** A `presence`: `participant` came `online` or went `offline` (per node). */
export interface PresenceChange extends AgentEventBase {
    readonly kind: "presenceChange";
    readonly participant: Participant | undefined;
    readonly status: string | undefined;
    readonly connections: number | undefined;
}

/**
 * A persistent frame that is not a turn for this agent: another party's answer or proactive
 * frame, a channel-scope REST post, or anything an observer sees.
 */
export interface ConversationMessage extends AgentEventBase {
    readonly kind: "message";
    readonly message: Message;
}

/** An enveloped frame of a type this SDK does not model. */
export interface OtherAgentFrame extends AgentEventBase {
    readonly kind: "other";
}

/** Everything {@link Agent.events} yields, discriminated by `kind`. */
export type AgentEvent =
    | ForwardedFrame
    | UserTyping
    | ReadReceipt
    | PresenceChange
    | ConversationMessage
    | OtherAgentFrame;

/** The typed event for an enveloped frame that is not a turn, an ack, a cancel or an error. */
export function parseAgentEvent(conversationId: string, frame: JsonObject): AgentEvent {
    const type = asString(frame.type) ?? "";
    const base = { conversationId, frame };
    if (isForwardedType(type)) {
        return {
            ...base,
            kind: "forwarded",
            type,
            clientId: asString(frame.clientId),
            data: asObject(frame.data),
        };
    }
    if (type === "typing") {
        return {
            ...base,
            kind: "userTyping",
            isTyping: frame.isTyping === true,
            sender: parseParticipant(frame.sender),
        };
    }
    const data = asObject(frame.data);
    if (type === "deliveryStatus") {
        return {
            ...base,
            kind: "readReceipt",
            upToSeq: asInt(data.upToSeq),
            status: asString(data.status),
            by: parseParticipant(data.by),
        };
    }
    if (type === "presence") {
        return {
            ...base,
            kind: "presenceChange",
            participant: parseParticipant(data.participant),
            status: asString(data.status),
            connections: asInt(data.connections),
        };
    }
    const message = parseMessage(frame);
    if (message !== undefined) {
        return { ...base, kind: "message", message };
    }
    return { ...base, kind: "other" };
}

/** What {@link Agent.on} can listen to, and what each listener receives. */
export interface AgentEventMap {
    /** Every {@link AgentEvent} (forwarded frames, typing, receipts, presence, other frames). */
    event: AgentEvent;
    /** A connection was welcomed (the first one and every reconnect). */
    connected: Welcome;
    /** A connection ended; a reconnect follows unless the agent stopped. */
    disconnected: Disconnect;
    /** A refusal that answers nothing this agent waits for (connection-level errors, …). */
    error: ServerError;
    /** The token sent with `auth` was accepted. */
    tokenRefreshed: JsonObject;
}

// --- Turns -------------------------------------------------------------------------------------

/** Why a turn's {@link Turn.signal} was aborted: its `cancel` (or the agent closed). */
export class TurnCancelled extends ConvergerError {
    /** `stopped`, `superseded`, `user_disconnected`, `conversation_closed`, or `agent_closed`. */
    readonly reason: string;
    readonly turnKey: string;

    constructor(turnKey: string, reason: string) {
        super(`turn ${turnKey} cancelled: ${reason}`);
        this.reason = reason;
        this.turnKey = turnKey;
    }
}

/** Options of the calls that wait for an ack. */
export interface AgentAckOptions {
    /** How long to wait for the ack, in ms (default 120 000; `null`: as long as the agent lives). */
    timeoutMs?: number | null;
}

/** The agent's side of a turn (private to the package). */
interface TurnHost {
    readonly agent: Agent;
    answer(
        turn: Turn,
        frames: JsonObject[],
        runtime: JsonObject | undefined,
        options: AnswerOptions,
    ): Promise<ReplyAck>;
    openStream(turn: Turn, streamId: string | undefined): AnswerStream<ReplyAck>;
}

const DEFAULT_ACK_TIMEOUT_MS = 120_000;

function ackTimeout(options: AgentAckOptions | undefined): number | null {
    return options?.timeoutMs === undefined ? DEFAULT_ACK_TIMEOUT_MS : options.timeoutMs;
}

/**
 * One user turn delivered to this agent (a revision of it).
 *
 * `seq`/`revision`/`key` come from `meta.turn` (answer with these, never with `frame.seq`, which
 * for an edit is the edit's own seq); `reason` is `"edit"` or `"regenerate"` above revision 0;
 * `fence` is the lease-mode fencing token; `runtime` is the conversation's runtime to build on
 * (the delivered one, or the newer one this agent wrote since); `frame` is the delivered frame
 * and `meta` its `meta`.
 *
 * `signal` is aborted when the end user stops the turn (`cancel`, docs/protocol.md §4.10) or
 * when the agent closes before the handler returned; its reason is a {@link TurnCancelled}.
 * Pass it on to whatever the handler awaits (a model's HTTP call, say). An answer sent within
 * the node's grace period is still the turn's result; after it a reply throws
 * {@link TurnStopped}.
 */
export class Turn implements StreamedTurn<ReplyAck> {
    readonly conversationId: string;
    readonly seq: number;
    readonly revision: number;
    readonly key: string;
    readonly reason: string | undefined;
    readonly fence: number | undefined;
    /** The runtime to build on: the delivered one, or the newer one this agent wrote since. */
    runtime: Runtime;
    readonly deliveredRuntime: Runtime;
    readonly frame: JsonObject;
    readonly meta: JsonObject;
    readonly participant: Participant | undefined;
    readonly channelId: string | undefined;
    readonly message: Message | undefined;
    /** The ack of this turn's answer, once it was answered. */
    ack: ReplyAck | undefined;
    readonly #host: TurnHost;
    readonly #controller = new AbortController();
    #cancelled: Promise<string> | undefined;

    /** @internal Turns are made by the agent. */
    constructor(
        host: TurnHost,
        conversationId: string,
        frame: JsonObject,
        meta: JsonObject,
        turnMeta: JsonObject,
    ) {
        this.#host = host;
        this.conversationId = conversationId;
        this.seq = asInt(turnMeta.seq) ?? 0;
        this.revision = asInt(turnMeta.revision) ?? 0;
        this.key = asString(turnMeta.key) ?? `${conversationId}:${this.seq}:${this.revision}`;
        this.reason = asString(turnMeta.reason);
        this.fence = asInt(turnMeta.fence);
        this.runtime = parseRuntime(meta.runtime);
        this.deliveredRuntime = this.runtime;
        this.frame = frame;
        this.meta = meta;
        this.participant = parseParticipant(meta.participant);
        this.channelId = asString(asObject(meta.channel).id);
        this.message = parseMessage(frame);
        this.ack = undefined;
    }

    /** The agent that received the turn. */
    get agent(): Agent {
        return this.#host.agent;
    }

    /** Aborted when the turn is cancelled; the reason is a {@link TurnCancelled}. */
    get signal(): AbortSignal {
        return this.#controller.signal;
    }

    /** True once the turn was cancelled (the end user stopped it, or the agent closed). */
    get cancelled(): boolean {
        return this.#controller.signal.aborted;
    }

    /** Why the turn was cancelled, once it was. */
    get cancelReason(): string | undefined {
        const reason: unknown = this.#controller.signal.reason;
        return reason instanceof TurnCancelled ? reason.reason : undefined;
    }

    /** Resolves with the reason once the turn is cancelled. */
    waitCancelled(): Promise<string> {
        this.#cancelled ??= new Promise((resolve) => {
            const settle = (): void => resolve(this.cancelReason ?? "stopped");
            if (this.cancelled) {
                settle();
                return;
            }
            this.signal.addEventListener("abort", settle, { once: true });
        });
        return this.#cancelled;
    }

    /** @internal Aborts the signal (a `cancel` arrived, or the agent closed). */
    cancel(reason: string): void {
        if (this.cancelled) {
            return;
        }
        this.#controller.abort(new TurnCancelled(this.key, reason));
    }

    /** The delivered frame's type (`text`, `event`, …). */
    get type(): string | undefined {
        return asString(this.frame.type);
    }

    /** The delivered frame's `data`. */
    get data(): JsonObject {
        return asObject(this.frame.data);
    }

    /** The user's text, for `text` turns. */
    get text(): string | undefined {
        return asString(this.data.text);
    }

    /** The end user's `meta` for this send (`meta.client`), when they gave any. */
    get client(): JsonObject | undefined {
        return isObject(this.meta.client) ? this.meta.client : undefined;
    }

    /** The clientId every send of this turn's answer uses. */
    get clientId(): string {
        return resultClientId(this.conversationId, this.seq, this.revision, this.fence);
    }

    /**
     * Answers the turn: an enveloped `turnResult`, resent with the same clientId until acked.
     *
     * `frames` are whole message frames (`{type: "text", data: {text}}`, a `tool_call`, an
     * `interrupt` with its own `id`, …); none completes the turn without storing anything.
     * `runtime` is the new runtime state, written against `this.runtime.version`
     * (`options.runtimeVersion` names another version). The result is resent every
     * `resendIntervalMs` and after every reconnect until the server answers, so a lost ack never
     * produces a second answer (the resend is acked with `duplicate: true`); retryable refusals
     * (`RESENT_CODES`: `internal`, `unavailable`, `rate_limited`, `too_many_in_flight`) are resent after their `retryAfterMs`.
     *
     * Throws {@link TurnConflict}, {@link TurnSuperseded}, {@link StaleRuntime},
     * {@link LeaseLost}, {@link TurnStopped} or {@link ServerError} for refusals,
     * {@link AckTimeout} when no answer came in time, and {@link FatalClose}, {@link GaveUp} or
     * {@link ClientClosed} when the agent stopped.
     */
    async answer(
        frames: readonly JsonObject[],
        runtime?: JsonObject,
        options: AnswerOptions = {},
    ): Promise<ReplyAck> {
        const ack = await this.#host.answer(this, framesOf(frames), runtime, options);
        this.ack = ack;
        return ack;
    }

    /** {@link answer} with a string (one `text` frame), a frame, or frames. */
    async reply(
        content: FrameLike | readonly FrameLike[],
        runtime?: JsonObject,
        options?: AnswerOptions,
    ): Promise<ReplyAck> {
        return this.answer(framesOf(content), runtime, options);
    }

    /** Shows (or hides) the agent typing to the conversation's end users (transient; false if not written). */
    typing(isTyping = true): Promise<boolean> {
        return this.#host.agent.typing(this.conversationId, isTyping);
    }

    /** Sends a `run` status frame with `data`, relayed as is (transient; false if not written). */
    runStatus(data: JsonObject): Promise<boolean> {
        return this.#host.agent.runStatus(this.conversationId, data);
    }

    /** Stores a proactive frame in this turn's conversation (see {@link Agent.send}). */
    send(frame: FrameLike, options?: AgentSendOptions): Promise<Ack> {
        return this.#host.agent.send(this.conversationId, frame, options);
    }

    /**
     * A streamed answer for this turn (docs/protocol.md §4.9); see {@link AnswerStream}.
     *
     * `streamId` must have the clientId shape and be unique in the conversation (a stream that
     * ended cannot be opened again); by default it is `stream-<seq>-<revision>-<16 random hex
     * digits>`, unique also across reconnects, takeovers and other workers. Nothing is sent until
     * the first chunk.
     */
    stream(streamId?: string): AnswerStream<ReplyAck> {
        return this.#host.openStream(this, streamId);
    }

    /**
     * Runs `write` with a new stream and ends the stream as a `finally` would: a `write` that
     * throws aborts the stream (reason `error`) and the error is rethrown; one that returns
     * without `finish()` or `abort()` commits the streamed text (see {@link AnswerStream.end}).
     */
    async streamWith<T>(
        write: (stream: AnswerStream<ReplyAck>) => Promise<T>,
        streamId?: string,
    ): Promise<T> {
        const stream = this.stream(streamId);
        let result: T;
        try {
            result = await write(stream);
        } catch (error) {
            await stream.end(error ?? new Error("the stream's writer failed"));
            throw error;
        }
        await stream.end();
        return result;
    }
}

// --- The agent -------------------------------------------------------------------------------

/** A keyed frame waiting for its ack. */
interface Outgoing {
    readonly clientId: string;
    readonly text: string;
    readonly conversationId: string;
    readonly runtimeWritten: Runtime | undefined;
    readonly settled: Promise<JsonObject>;
    resolve(frame: JsonObject): void;
    reject(error: unknown): void;
    timer: ReturnType<typeof setTimeout> | undefined;
}

/** Options of {@link Agent.send}. */
export interface AgentSendOptions extends AgentAckOptions {
    /** The idempotency key (default: the frame's own `clientId`, else a fresh one). */
    clientId?: string;
}

/** Options of {@link Agent.run}. */
export interface RunOptions {
    /** How many turns are handled at once (default 1); a conversation's turns one at a time. */
    concurrency?: number;
    /** On stop, how long running handlers and unacked answers get before the close (default 10 s). */
    drainTimeoutMs?: number;
}

/** Answers one turn. */
export type TurnHandler = (turn: Turn) => Promise<void>;

type Listener<K extends keyof AgentEventMap> = (value: AgentEventMap[K]) => void;

/**
 * An agent connection to one node, serving the conversations of its token's channel.
 *
 * `url` is the node's WebSocket endpoint (`ws://host:port/socket/converger/v1`; an
 * `http://host:port` base works too), `token` a channel-scope token. See {@link AgentOptions}.
 *
 * Call {@link connect} (or {@link run}, which connects), then take turns from {@link turns} or
 * hand them to the handler of {@link run}; other frames come from {@link events} or
 * {@link on}. {@link close} (or {@link stop} under `run`) ends it.
 */
export class Agent {
    readonly url: string;
    readonly group: string | undefined;
    readonly claim: "lease" | undefined;
    #token: string;
    readonly #backoff: Backoff;
    readonly #openTimeoutMs: number;
    readonly #resendIntervalMs: number;
    readonly #helloWatermarks: number;
    readonly #WebSocket: WebSocketConstructor | undefined;
    readonly #refreshHook: (() => Promise<string> | string) | undefined;
    readonly #logger: AgentLogger;
    readonly #tracker: ChannelTracker;
    readonly #runtimes = new Map<string, Runtime>();
    readonly #outbox = new Map<string, Outgoing>();
    readonly #outboxEmpty = new ChangeSignal();
    readonly #turnQueue = new AsyncQueue<Turn>();
    #eventQueue: AsyncQueue<AgentEvent> | undefined;
    readonly #listeners = new Listeners<AgentEventMap>((kind, error) => {
        this.#log("error", `a ${String(kind)} listener failed: ${String(error)}`);
    });
    #connection: Connection | undefined;
    #welcome: Welcome | undefined;
    readonly #changed = new ChangeSignal();
    /** Aborted by close(): wakes the reconnect loop's sleeps. */
    readonly #lifetime = new AbortController();
    #supervisor: Promise<void> | undefined;
    #fatal: ConvergerError | undefined;
    #lastError: ServerError | undefined;
    #lastHintMs: number | undefined;
    #lastDisconnect: Disconnect | undefined;
    #connectedAt: number | undefined;
    #connections = 0;
    #stopping = false;
    #closed = false;
    #closing: Promise<void> | undefined;
    #tokenExpired = false;
    #refreshTimer: ReturnType<typeof setTimeout> | undefined;
    #watchdog: ReturnType<typeof setInterval> | undefined;
    readonly #handlers = new Set<Promise<void>>();
    readonly #liveTurns = new Map<string, Turn>();
    readonly #streams = new Map<string, WeakRef<AnswerStream<ReplyAck>>>();
    readonly #turnHost: TurnHost;
    readonly #streamHost: StreamHost;

    constructor(url: string, token: string, options: AgentOptions = {}) {
        if (options.claim !== undefined && options.claim !== "lease") {
            throw new RangeError(`unknown claim mode ${String(options.claim)}`);
        }
        if (options.claim === "lease" && options.group === undefined) {
            throw new RangeError("lease mode needs a group");
        }
        this.url = wsUrl(url);
        this.#token = token;
        this.group = options.group;
        this.claim = options.claim;
        this.#backoff = options.backoff ?? new Backoff();
        this.#openTimeoutMs = options.openTimeoutMs ?? DEFAULT_OPEN_TIMEOUT_MS;
        this.#resendIntervalMs = options.resendIntervalMs ?? 5000;
        this.#helloWatermarks = options.helloWatermarks ?? 500;
        this.#WebSocket = options.WebSocket;
        this.#refreshHook = options.refreshToken;
        this.#logger = options.logger ?? CONSOLE_LOGGER;
        this.#tracker = new ChannelTracker(options.watermarks ?? {});
        this.#turnHost = {
            agent: this,
            answer: (turn, frames, runtime, options) =>
                this.#answer(turn, frames, runtime, options),
            openStream: (turn, streamId) => this.#openStream(turn, streamId),
        };
        const agent = this;
        this.#streamHost = {
            get connections() {
                return agent.#connections;
            },
            get connected() {
                return agent.#connection !== undefined;
            },
            get maxFrameBytes() {
                return agent.#maxFrameBytes();
            },
            requireAlive: () => this.#requireAlive(),
            writeEnvelope: (conversationId, frame) => this.#writeEnvelope(conversationId, frame),
            writeText: (text) => this.#write(text),
            forgetStream: (stream) => this.#forgetStream(stream),
            warn: (message) => this.#log("warn", message),
        };
    }

    // --- state -------------------------------------------------------------------------

    /** The latest `welcome` (replaced on every reconnect: new connectionId and since). */
    get welcome(): Welcome {
        if (this.#welcome === undefined) {
            throw new ConvergerError("the agent is not connected yet");
        }
        return this.#welcome;
    }

    /** Whether a welcomed connection is open right now. */
    get connected(): boolean {
        return this.#connection !== undefined;
    }

    /** How many connections were welcomed so far (1 after {@link connect}). */
    get connections(): number {
        return this.#connections;
    }

    /** `Date.now()` when the current connection was welcomed. */
    get connectedAt(): number | undefined {
        return this.#connectedAt;
    }

    /** How the last connection ended (undefined while the first one is open). */
    get lastDisconnect(): Disconnect | undefined {
        return this.#lastDisconnect;
    }

    /** Per conversation, the highest seq seen: what the next `hello.watermarks` names. */
    get watermarks(): Record<string, number> {
        return this.#tracker.watermarks();
    }

    /** ClientIds of the answers and proactive frames still waiting for their ack. */
    get unacked(): string[] {
        return [...this.#outbox.keys()];
    }

    /** Why the agent stopped for good ({@link FatalClose}, {@link GaveUp}), once it did. */
    get failure(): ConvergerError | undefined {
        return this.#fatal;
    }

    /**
     * Waits until a connection is open and at least `connections` were welcomed so far
     * (`agent.connections + 1` waits for the next reconnect). Throws a ConvergerError after
     * `timeoutMs` (default 30 s), the fatal error when the agent stopped for good, and
     * {@link ClientClosed} once it was closed.
     */
    async waitConnected(
        options: { timeoutMs?: number; connections?: number } = {},
    ): Promise<Welcome> {
        const wanted = options.connections ?? 1;
        const timeoutMs = options.timeoutMs ?? 30_000;
        return waitUntil(
            this.#changed,
            () => {
                if (this.#connection !== undefined && this.#connections >= wanted) {
                    return this.welcome;
                }
                this.#requireAlive();
                return undefined;
            },
            timeoutMs,
            () =>
                new ConvergerError(`not connected (${wanted} connections) within ${timeoutMs} ms`),
        );
    }

    /**
     * Waits until this member's `welcome.since` has passed on this machine's clock.
     *
     * A member owns nothing committed before its `since` (unless it is alone in its group); on
     * the node's machine, this is when turns start to reach it.
     */
    async waitEligible(): Promise<void> {
        const since = this.welcome.since;
        if (since === undefined) {
            return;
        }
        await delay(since - Date.now() + 20);
    }

    // --- lifecycle ---------------------------------------------------------------------

    /**
     * Opens the first connection (one attempt) and starts serving.
     *
     * Throws {@link FatalClose} when the node refuses the hello for good (bad token, inactive
     * channel, bad group) and {@link GaveUp} when it cannot be reached. Later disconnections are
     * reconnected in the background.
     */
    async connect(): Promise<Welcome> {
        this.#requireAlive();
        if (this.#supervisor !== undefined) {
            return this.welcome;
        }
        let opened: OpenedSession;
        try {
            opened = await this.#open();
        } catch (error) {
            if (error instanceof ConnectFailed) {
                throw new GaveUp(1, error);
            }
            if (
                !(
                    error instanceof FatalClose &&
                    error.tokenExpired &&
                    (await this.#refreshFromHook())
                )
            ) {
                throw error;
            }
            // The hook gave a fresh token: one more attempt with it.
            try {
                opened = await this.#open();
            } catch (retried) {
                throw retried instanceof ConnectFailed ? new GaveUp(2, retried) : retried;
            }
        }
        if (this.#closed) {
            // close() ran while the socket was opening: it must not outlive the agent.
            opened.connection.close(1000, "");
            throw new ClientClosed("the agent was closed while connecting");
        }
        if (this.#supervisor !== undefined) {
            // Another connect() won the race.
            opened.connection.close(1000, "");
            return this.welcome;
        }
        this.#attach(opened);
        this.#supervisor = this.#supervise();
        return this.welcome;
    }

    /**
     * Stops handing out turns; {@link run} then drains and returns.
     *
     * Turns delivered but not started are dropped: once this agent leaves its group, the server
     * hands its unanswered turns to the other members.
     */
    stop(): void {
        if (this.#stopping) {
            return;
        }
        this.#stopping = true;
        this.#turnQueue.clear();
        this.#turnQueue.close();
        this.#eventQueue?.close();
    }

    /**
     * Stops, lets running handlers and unacked answers finish, then closes (1000).
     *
     * Waits at most `timeoutMs` in all (default 10 s) for the handlers {@link run} started and for
     * the acks of the frames still waiting; then the turns still handled are cancelled (their
     * `signal` aborts with reason `agent_closed`) and what still waits fails with
     * {@link ClientClosed}. Do not await it from inside a handler (call {@link stop}).
     */
    close(options: { timeoutMs?: number } = {}): Promise<void> {
        this.#closing ??= this.#closeOnce(options.timeoutMs ?? 10_000);
        return this.#closing;
    }

    async #closeOnce(timeoutMs: number): Promise<void> {
        this.stop();
        const deadline = Date.now() + Math.max(timeoutMs, 0);
        const timeout = (): ConvergerError => new ConvergerError("drain timeout");
        if (this.#handlers.size > 0) {
            await within(
                Promise.allSettled([...this.#handlers]),
                deadline - Date.now(),
                timeout,
            ).catch(() => undefined);
        }
        if (this.#outbox.size > 0 && this.#fatal === undefined && this.#supervisor !== undefined) {
            await within(this.#outboxDrained(), deadline - Date.now(), timeout).catch(
                () => undefined,
            );
        }
        this.#closed = true;
        clearTimeout(this.#refreshTimer);
        for (const turn of this.#liveTurns.values()) {
            // Whatever still works on an unanswered turn is told to stop.
            if (turn.ack === undefined) {
                turn.cancel("agent_closed");
            }
        }
        this.#lifetime.abort();
        const connection = this.#connection;
        this.#detach();
        connection?.close(1000, "");
        this.#failOutbox(new ClientClosed("the agent was closed before the server answered"));
        this.#turnQueue.close();
        this.#eventQueue?.close();
        if (this.#supervisor !== undefined) {
            await within(this.#supervisor, this.#openTimeoutMs, timeout).catch(() => undefined);
        }
        this.#changed.notify();
    }

    async #outboxDrained(): Promise<void> {
        while (this.#outbox.size > 0 && this.#fatal === undefined) {
            await this.#outboxEmpty.next();
        }
    }

    // --- handler style -----------------------------------------------------------------

    /**
     * Serves turns with `handler` until {@link stop} (or a fatal close).
     *
     * Up to `concurrency` turns are handled at once; the turns of one conversation are handled
     * one at a time, in delivery order, each seeing the runtime the previous answer wrote. A
     * handler that throws is logged; its turn may come again (a replay, a sync). Connects first
     * when needed. On stop the running handlers and unacked answers get `drainTimeoutMs`, then
     * the agent closes; a fatal close ({@link FatalClose}, {@link GaveUp}) is thrown after that.
     */
    async run(handler: TurnHandler, options: RunOptions = {}): Promise<void> {
        const concurrency = options.concurrency ?? 1;
        if (!Number.isInteger(concurrency) || concurrency < 1) {
            throw new RangeError("concurrency must be an integer of at least 1");
        }
        if (this.#supervisor === undefined) {
            await this.connect();
        }
        const limiter = new Semaphore(concurrency);
        const chains = new Map<string, Promise<void>>();
        try {
            for await (const turn of this.turns()) {
                const previous = chains.get(turn.conversationId) ?? Promise.resolve();
                const task = previous.then(() => this.#handle(turn, handler, limiter));
                chains.set(turn.conversationId, task);
                this.#handlers.add(task);
                void task.finally(() => {
                    this.#handlers.delete(task);
                    if (chains.get(turn.conversationId) === task) {
                        chains.delete(turn.conversationId);
                    }
                });
            }
        } finally {
            await this.close({ timeoutMs: options.drainTimeoutMs ?? 10_000 });
        }
    }

    async #handle(turn: Turn, handler: TurnHandler, limiter: Semaphore): Promise<void> {
        await limiter.acquire();
        try {
            if (this.#stopping || turn.cancelled) {
                return;
            }
            this.#freshen(turn);
            await handler(turn);
        } catch (error) {
            this.#handlerFailed(turn, error);
        } finally {
            limiter.release();
        }
    }

    #handlerFailed(turn: Turn, error: unknown): void {
        if (turn.cancelled) {
            this.#log("info", `turn ${turn.key}: cancelled (${turn.cancelReason ?? "stopped"})`);
            return;
        }
        if (
            error instanceof TurnConflict ||
            error instanceof TurnSuperseded ||
            error instanceof TurnStopped ||
            error instanceof LeaseLost ||
            error instanceof StreamClosed
        ) {
            this.#log("info", `turn ${turn.key}: answer dropped: ${error.message}`);
            return;
        }
        if (
            error instanceof ClientClosed ||
            error instanceof FatalClose ||
            error instanceof GaveUp
        ) {
            return;
        }
        const why = error instanceof Error ? (error.stack ?? error.message) : String(error);
        this.#log(
            error instanceof StreamInterrupted || error instanceof StaleRuntime ? "warn" : "error",
            `turn ${turn.key}: the handler failed: ${why}`,
        );
        // Forget the hand-out, so a later replay (a sync, the next hello) brings the turn again.
        this.#tracker.forgetDelivery(turn.conversationId, turn.seq, turn.revision);
    }

    // --- iterator style ----------------------------------------------------------------

    /**
     * The turns delivered to this agent, each delivery once, until {@link stop}.
     *
     * A turn comes again only as a new revision (an edit, a regeneration) or, in lease mode,
     * under a newer claim (a higher fence). Throws {@link FatalClose} or {@link GaveUp} at the end
     * when the agent stopped for good. Every iterator reads the same queue.
     */
    async *turns(): AsyncGenerator<Turn, void, undefined> {
        for (;;) {
            const next = await this.#turnQueue.next();
            if (next.done === true) {
                if (this.#fatal !== undefined) {
                    throw this.#fatal;
                }
                return;
            }
            this.#freshen(next.value);
            yield next.value;
        }
    }

    /**
     * Everything else delivered to this agent, typed, until {@link stop}: forwarded client frames
     * (`resume`, `abort`, …), end users' typing, read receipts and presence, and other parties'
     * persistent frames. Events are kept from the first call on; earlier ones are dropped.
     */
    events(): AsyncGenerator<AgentEvent, void, undefined> {
        // The queue exists from this call on, not from the first read: a generator's body runs
        // only when it is first read, and events arriving in between would be lost.
        return Agent.#drain(this.#events());
    }

    static async *#drain(
        queue: AsyncQueue<AgentEvent>,
    ): AsyncGenerator<AgentEvent, void, undefined> {
        for (;;) {
            const next = await queue.next();
            if (next.done === true) {
                return;
            }
            yield next.value;
        }
    }

    #events(): AsyncQueue<AgentEvent> {
        if (this.#eventQueue === undefined) {
            this.#eventQueue = new AsyncQueue();
            if (this.#stopping) {
                this.#eventQueue.close();
            }
        }
        return this.#eventQueue;
    }

    /** Calls `listener` for each `kind` (see {@link AgentEventMap}); returns the unsubscribe. */
    on<K extends keyof AgentEventMap>(kind: K, listener: Listener<K>): () => void {
        return this.#listeners.on(kind, listener);
    }

    // --- sending -----------------------------------------------------------------------

    /**
     * Stores a proactive frame (not an answer to a turn) and returns its ack.
     *
     * The frame is idempotent by its clientId (`clientId`, else the frame's own, else a fresh
     * one) per conversation and sender: it is resent until acked, and a resend is acked with
     * `duplicate: true` without storing anything again. Refusals throw {@link ServerError}.
     */
    async send(
        conversationId: string,
        frame: FrameLike,
        options: AgentSendOptions = {},
    ): Promise<Ack> {
        const [body] = framesOf(frame);
        if (body === undefined) {
            throw new TypeError("no frame to send");
        }
        const clientId = options.clientId ?? asString(body.clientId) ?? `p-${randomHex()}`;
        body.clientId = clientId;
        const acked = await this.#submit(
            clientId,
            { conversationId, frame: body },
            conversationId,
            undefined,
            ackTimeout(options),
        );
        return parseAck(acked);
    }

    /** Relays `typing` to the conversation's end users (transient; false if not written). */
    typing(conversationId: string, isTyping = true): Promise<boolean> {
        return this.#writeEnvelope(conversationId, { type: "typing", isTyping });
    }

    /** Relays a `run` frame, `data` verbatim (transient; false if not written). */
    runStatus(conversationId: string, data: JsonObject): Promise<boolean> {
        return this.#writeEnvelope(conversationId, { type: "run", data: { ...data } });
    }

    /** Relays an `error` frame (`busy`, `interrupted`, …) to the end users (transient). */
    relayError(
        conversationId: string,
        code: string,
        message?: string,
        fields: JsonObject = {},
    ): Promise<boolean> {
        const data: JsonObject = { ...fields, code };
        if (message !== undefined) {
            data.message = message;
        }
        return this.#writeEnvelope(conversationId, { type: "error", data });
    }

    /**
     * Asks for the frames after `watermark` that this member owns (transient). Turns come back as
     * turns, except the deliveries already handed out.
     */
    sync(conversationId: string, watermark: number): Promise<boolean> {
        return this.#writeEnvelope(conversationId, {
            type: "sync",
            watermark: Math.max(watermark, 0),
        });
    }

    /** Uses `token` from now on: sent as `auth` on the open socket and in later hellos. */
    async refreshToken(token: string): Promise<boolean> {
        this.#token = token;
        this.#tokenExpired = false;
        return this.#write(stringify({ type: "auth", token }));
    }

    #openStream(turn: Turn, streamId: string | undefined): AnswerStream<ReplyAck> {
        const id = streamId ?? `stream-${turn.seq}-${turn.revision}-${randomHex().slice(0, 16)}`;
        if (!isValidClientId(id)) {
            throw new RangeError(
                `invalid streamId ${JSON.stringify(id)} (1-128 of A-Za-z0-9._:~-)`,
            );
        }
        const key = streamKey(turn.conversationId, id);
        if (this.#streams.get(key)?.deref() !== undefined) {
            throw new RangeError(`stream ${id} is already open in this conversation`);
        }
        this.#requireAlive();
        const stream = new AnswerStream<ReplyAck>(this.#streamHost, turn, id);
        // Weakly held: a stream its writer dropped without ending it must not be kept forever.
        this.#streams.set(key, new WeakRef(stream));
        if (this.#streams.size > 1024) {
            for (const [oldKey, ref] of this.#streams) {
                if (ref.deref() === undefined) {
                    this.#streams.delete(oldKey);
                }
            }
        }
        return stream;
    }

    #forgetStream(stream: AnswerStream<unknown>): void {
        const key = streamKey(stream.conversationId, stream.streamId);
        if (this.#streams.get(key)?.deref() === stream) {
            this.#streams.delete(key);
        }
    }

    #requireAlive(): void {
        if (this.#fatal !== undefined) {
            throw this.#fatal;
        }
        if (this.#closed) {
            throw new ClientClosed("the agent is closed");
        }
    }

    #maxFrameBytes(): number {
        return this.#welcome?.limits.maxFrameBytes ?? HELLO_FRAME_BYTES;
    }

    async #answer(
        turn: Turn,
        frames: JsonObject[],
        runtime: JsonObject | undefined,
        options: AnswerOptions,
    ): Promise<ReplyAck> {
        const reference: JsonObject = { seq: turn.seq, revision: turn.revision };
        if (turn.fence !== undefined) {
            reference.fence = turn.fence;
        }
        const result: JsonObject = {
            type: "turnResult",
            clientId: turn.clientId,
            turn: reference,
            frames,
        };
        let written: Runtime | undefined;
        if (runtime !== undefined) {
            written = {
                version: options.runtimeVersion ?? turn.runtime.version,
                state: { ...runtime },
            };
            result.runtime = { version: written.version, state: written.state };
        }
        const envelope = { conversationId: turn.conversationId, frame: result };
        const acked = await this.#submit(
            turn.clientId,
            envelope,
            turn.conversationId,
            written,
            ackTimeout(options),
        );
        return parseReplyAck(acked);
    }

    async #submit(
        clientId: string,
        envelope: JsonObject,
        conversationId: string,
        runtimeWritten: Runtime | undefined,
        timeoutMs: number | null,
    ): Promise<JsonObject> {
        this.#requireAlive();
        const text = stringify(envelope);
        const size = byteLength(text);
        if (this.#welcome !== undefined && size > this.#maxFrameBytes()) {
            throw new FrameTooLarge(size, this.#maxFrameBytes());
        }
        let entry = this.#outbox.get(clientId);
        if (entry !== undefined && entry.text !== text) {
            throw new RangeError(
                `another frame with clientId ${clientId} is still waiting for its ack`,
            );
        }
        if (entry === undefined) {
            entry = newOutgoing(clientId, text, conversationId, runtimeWritten);
            this.#outbox.set(clientId, entry);
            this.#transmit(entry);
        }
        const waiting = entry;
        return within(waiting.settled, timeoutMs, () => {
            const timedOut = new AckTimeout(clientId, timeoutMs ?? 0);
            // No longer resent: the caller gave up on it (it may still have been committed). The
            // entry is rejected too, so another waiter of the same clientId (with no timeout of
            // its own) does not wait forever for an entry that left the outbox.
            if (this.#outbox.get(clientId) === waiting) {
                this.#settle(clientId);
                waiting.reject(timedOut);
            }
            return timedOut;
        });
    }

    /** Sends `entry` now (when connected) and schedules its resend. */
    #transmit(entry: Outgoing): void {
        clearTimeout(entry.timer);
        this.#connection?.send(entry.text);
        this.#scheduleResend(entry, this.#resendIntervalMs);
    }

    #scheduleResend(entry: Outgoing, afterMs: number): void {
        clearTimeout(entry.timer);
        entry.timer = setTimeout(() => {
            if (this.#outbox.get(entry.clientId) === entry) {
                this.#transmit(entry);
            }
        }, afterMs);
    }

    #settle(clientId: string): Outgoing | undefined {
        const entry = this.#outbox.get(clientId);
        if (entry === undefined) {
            return undefined;
        }
        clearTimeout(entry.timer);
        this.#outbox.delete(clientId);
        if (this.#outbox.size === 0) {
            this.#outboxEmpty.notify();
        }
        return entry;
    }

    #failOutbox(error: ConvergerError): void {
        for (const clientId of [...this.#outbox.keys()]) {
            this.#settle(clientId)?.reject(error);
        }
    }

    /** Writes an enveloped frame and waits while the socket's buffer is full; false when down. */
    #writeEnvelope(conversationId: string, frame: JsonObject): Promise<boolean> {
        return this.#write(stringify({ conversationId, frame }));
    }

    async #write(text: string): Promise<boolean> {
        const connection = this.#connection;
        if (connection === undefined || !connection.send(text)) {
            return false;
        }
        // Flow control: a producer faster than the network waits here rather than filling memory.
        const deadline = Date.now() + SEND_BUFFER_WAIT_MS;
        while (
            connection.socket.bufferedAmount > SEND_BUFFER_HIGH_WATER &&
            connection === this.#connection &&
            Date.now() < deadline
        ) {
            await delay(SEND_BUFFER_POLL_MS);
        }
        return true;
    }

    // --- connection --------------------------------------------------------------------

    #hello(): JsonObject {
        const hello: JsonObject = { type: "hello", protocol: "converger/1", token: this.#token };
        if (this.group !== undefined) {
            hello.group = this.group;
        }
        if (this.claim !== undefined) {
            hello.claim = this.claim;
        }
        // The hello must stay well under maxFrameBytes: name the most recently active first.
        let budget =
            Math.floor((this.#maxFrameBytes() * 3) / 4) - byteLength(stringify(hello)) - 32;
        const watermarks: Record<string, number> = {};
        let any = false;
        for (const [conversationId, seq] of Object.entries(
            this.#tracker.watermarks(this.#helloWatermarks),
        )) {
            budget -= conversationId.length + String(seq).length + 6;
            if (budget < 0) {
                break;
            }
            watermarks[conversationId] = seq;
            any = true;
        }
        if (any) {
            hello.watermarks = watermarks;
        }
        return hello;
    }

    #open(): Promise<OpenedSession> {
        return openSession(this.url, this.#hello(), {
            timeoutMs: this.#openTimeoutMs,
            WebSocket: this.#WebSocket,
            signal: this.#lifetime.signal,
        });
    }

    #attach(opened: OpenedSession): void {
        this.#connection = opened.connection;
        this.#welcome = parseWelcome(opened.welcome);
        this.#lastError = undefined;
        this.#lastHintMs = undefined;
        this.#tokenExpired = false;
        this.#connections += 1;
        this.#connectedAt = Date.now();
        const welcome = this.#welcome;
        this.#log(
            "info",
            `connected: ${welcome.group !== undefined ? `member of ${welcome.group}` : "observer"} as ${welcome.connectionId} since ${welcome.since}${welcome.claim === "lease" ? " (lease mode)" : ""}`,
        );
        for (const message of opened.early) {
            this.#onMessage(message);
        }
        opened.connection.onMessage((message) => this.#onMessage(message));
        this.#watch(opened.connection, welcome.limits.heartbeatIntervalMs);
        this.#scheduleTokenRefresh(welcome.expiresAt);
        this.#changed.notify();
        this.#listeners.emit("connected", welcome);
        for (const entry of [...this.#outbox.values()]) {
            this.#transmit(entry);
        }
    }

    #detach(): void {
        clearInterval(this.#watchdog);
        this.#watchdog = undefined;
        this.#connection = undefined;
        this.#changed.notify();
    }

    /** Drops `connection` when the node has been silent too long (a dead path sends no close). */
    #watch(connection: Connection, heartbeatIntervalMs: number): void {
        clearInterval(this.#watchdog);
        const silenceMs = silenceLimitMs(heartbeatIntervalMs);
        this.#watchdog = setInterval(() => {
            if (connection !== this.#connection) {
                return;
            }
            if (connection.abandonIfSilent(heartbeatIntervalMs)) {
                this.#log("warn", `no heartbeat for ${silenceMs} ms; reconnecting`);
            }
        }, WATCHDOG_TICK_MS);
    }

    async #supervise(): Promise<void> {
        try {
            for (;;) {
                const connection = this.#connection;
                if (connection === undefined) {
                    return;
                }
                const close = await connection.closed;
                if (this.#closed) {
                    return;
                }
                // Detached before #onClosed awaits a token refresh: meanwhile the agent is not
                // connected, and nothing is written to the dead socket.
                this.#detach();
                const hint = await this.#onClosed(close);
                if (this.#closed) {
                    return;
                }
                await this.#reconnect(hint);
            }
        } catch (error) {
            if (this.#closed) {
                return; // close() cut a reconnect short: nothing failed
            }
            if (error instanceof FatalClose || error instanceof GaveUp) {
                this.#log("error", `stopped: ${error.message}`);
                this.#fail(error);
                return;
            }
            // A bug: stop loudly rather than hang.
            this.#log("error", `the connection loop failed: ${String(error)}`);
            this.#fail(
                new ConvergerError(`the connection loop failed: ${String(error)}`, {
                    cause: error,
                }),
            );
        }
    }

    /** Reads how a connection ended; returns the reconnect hint or throws {@link FatalClose}. */
    async #onClosed(close: CloseInfo): Promise<number | undefined> {
        this.#lastDisconnect = disconnectOf(close, this.#lastHintMs);
        const hint = this.#lastDisconnect.retryAfterMs;
        this.#listeners.emit("disconnected", this.#lastDisconnect);
        if (FATAL_CLOSE_CODES.has(close.code)) {
            const fatal = new FatalClose(close.code, close.reason, this.#lastError);
            const expired = this.#tokenExpired || fatal.tokenExpired;
            if (!(expired && (await this.#refreshFromHook()))) {
                throw fatal;
            }
            this.#log("info", "the token expired; reconnecting with a fresh one");
            return hint;
        }
        const how = close.reason === "" ? String(close.code) : `${close.code} ${close.reason}`;
        this.#log("warn", `disconnected (${how}); reconnecting`);
        return hint;
    }

    async #reconnect(hint: number | undefined): Promise<void> {
        let attempt = 0;
        let retryAfterMs = hint;
        for (;;) {
            await sleep(this.#backoff.delay(attempt, retryAfterMs), this.#lifetime.signal);
            if (this.#closed) {
                return;
            }
            let opened: OpenedSession;
            try {
                opened = await this.#open();
            } catch (error) {
                attempt += 1;
                if (
                    error instanceof FatalClose &&
                    error.tokenExpired &&
                    (await this.#refreshFromHook())
                ) {
                    retryAfterMs = undefined;
                } else if (error instanceof ConnectFailed) {
                    retryAfterMs = error.retryAfterMs;
                    this.#log("warn", `reconnect attempt ${attempt} failed: ${error.message}`);
                } else {
                    throw error;
                }
                // Counted either way: a hook that keeps giving refused tokens must not loop forever.
                if (this.#backoff.exhausted(attempt)) {
                    throw new GaveUp(attempt, error);
                }
                continue;
            }
            if (this.#closed) {
                opened.connection.close(1000, "");
                return;
            }
            this.#attach(opened);
            return;
        }
    }

    #fail(error: ConvergerError): void {
        this.#fatal = error;
        clearTimeout(this.#refreshTimer);
        this.#detach();
        this.#failOutbox(error);
        this.#stopping = true;
        this.#turnQueue.close();
        this.#eventQueue?.close();
        this.#changed.notify();
        this.#outboxEmpty.notify();
    }

    /** Asks the hook for a fresh token; false without a hook or when it failed. */
    async #refreshFromHook(): Promise<boolean> {
        const hook = this.#refreshHook;
        if (hook === undefined) {
            return false;
        }
        try {
            const token = await within(
                Promise.resolve(hook()),
                REFRESH_HOOK_TIMEOUT_MS,
                () => new ConvergerError("the token refresh hook timed out"),
            );
            if (typeof token !== "string" || token === "") {
                return false;
            }
            this.#token = token;
            this.#tokenExpired = false;
            return true;
        } catch (error) {
            this.#log("error", `the token refresh hook failed: ${String(error)}`);
            return false;
        }
    }

    /** With a refresh hook, refreshes the token on the open socket shortly before it expires. */
    #scheduleTokenRefresh(expiresAt: number | undefined): void {
        clearTimeout(this.#refreshTimer);
        if (this.#refreshHook === undefined || expiresAt === undefined || this.#closed) {
            return;
        }
        const left = expiresAt - Date.now();
        // A minute early, or at 80% of a short lifetime.
        const margin = Math.min(60_000, Math.max(left, 0) / 5);
        this.#refreshTimer = setTimeout(
            () => {
                void this.#refreshFromHook().then(async (refreshed) => {
                    if (refreshed) {
                        await this.#write(stringify({ type: "auth", token: this.#token }));
                    }
                });
            },
            Math.min(Math.max(left - margin, 0), LONGEST_TIMER_MS),
        );
        // The refresh timer alone must not keep a process alive.
        this.#refreshTimer.unref?.();
    }

    // --- receiving ---------------------------------------------------------------------

    #onMessage(message: JsonObject): void {
        try {
            this.#dispatch(message);
        } catch (error) {
            this.#log(
                "error",
                `could not handle ${stringify(message).slice(0, 200)}: ${String(error)}`,
            );
        }
    }

    #dispatch(message: JsonObject): void {
        const conversationId = asString(message.conversationId);
        const frame = message.frame;
        if (conversationId === undefined || !isObject(frame)) {
            this.#onBare(message);
            return;
        }
        const kind = asString(frame.type);
        if (kind === "ack") {
            this.#onAck(conversationId, frame);
            return;
        }
        if (kind === "cancel") {
            const key = asString(asObject(frame.turn).key) ?? "";
            this.#liveTurns.get(key)?.cancel(asString(frame.reason) ?? "stopped");
            return;
        }
        if (kind === "error") {
            this.#onError(asObject(frame.data), conversationId);
            return;
        }
        const seq = asInt(frame.seq);
        if (seq !== undefined) {
            this.#tracker.observeSeq(conversationId, seq);
        }
        const meta = asObject(frame.meta);
        const turnMeta = meta.turn;
        if (isObject(turnMeta) && asInt(turnMeta.seq) !== undefined) {
            this.#onTurn(new Turn(this.#turnHost, conversationId, frame, meta, turnMeta));
            return;
        }
        if (this.#stopping) {
            return;
        }
        if (this.#eventQueue === undefined && !this.#listeners.has("event")) {
            return;
        }
        const event = parseAgentEvent(conversationId, frame);
        this.#eventQueue?.push(event);
        this.#listeners.emit("event", event);
    }

    #onTurn(turn: Turn): void {
        if (this.#stopping) {
            return;
        }
        if (
            !this.#tracker.firstDelivery(turn.conversationId, turn.seq, turn.revision, turn.fence)
        ) {
            return;
        }
        touch(this.#liveTurns, turn.key, turn, CANCELLABLE_TURNS);
        this.#turnQueue.push(turn);
    }

    /** Builds on the runtime this agent wrote when it is newer than the delivered one. */
    #freshen(turn: Turn): void {
        const known = this.#runtimes.get(turn.conversationId);
        if (known !== undefined && known.version > turn.runtime.version) {
            turn.runtime = known;
        }
    }

    #rememberRuntime(conversationId: string, runtime: Runtime): void {
        const known = this.#runtimes.get(conversationId);
        const newest = known === undefined || runtime.version >= known.version ? runtime : known;
        touch(this.#runtimes, conversationId, newest, REMEMBERED_CONVERSATIONS);
    }

    #onAck(conversationId: string, frame: JsonObject): void {
        const clientId = asString(frame.clientId);
        if (clientId === undefined) {
            return;
        }
        const entry = this.#settle(clientId);
        if (entry === undefined) {
            return; // a late duplicate ack of something already settled
        }
        if (entry.runtimeWritten !== undefined) {
            const written = entry.runtimeWritten;
            this.#rememberRuntime(conversationId, {
                version: written.version + 1,
                state: written.state,
            });
        }
        entry.resolve(frame);
    }

    #onError(data: JsonObject, conversationId: string | undefined): void {
        const error = ServerError.fromData(data);
        const entry = error.clientId !== undefined ? this.#outbox.get(error.clientId) : undefined;
        if (entry !== undefined) {
            if (RESENT_CODES.has(error.code)) {
                const waitMs = error.retryAfterMs ?? DEFAULT_RETRY_AFTER_MS;
                this.#log(
                    "info",
                    `${entry.clientId} refused with ${error.message}; resending in ${waitMs} ms`,
                );
                this.#scheduleResend(entry, waitMs);
                return;
            }
            this.#settle(entry.clientId);
            if (error instanceof StaleRuntime) {
                this.#runtimes.delete(entry.conversationId);
            }
            entry.reject(error);
            return;
        }
        if (
            conversationId !== undefined &&
            error.frameType !== undefined &&
            STREAM_FRAME_TYPES.has(error.frameType)
        ) {
            const stream = this.#streams
                .get(streamKey(conversationId, error.streamId ?? ""))
                ?.deref();
            if (stream !== undefined && error.frameType === "streamChunk") {
                stream.refused(error);
                return;
            }
            this.#log("debug", `stream error in conversation ${conversationId}: ${error.message}`);
            return;
        }
        if (conversationId === undefined) {
            this.#onConnectionError(error);
        } else {
            this.#log("warn", `error in conversation ${conversationId}: ${error.message}`);
        }
        this.#listeners.emit("error", error);
    }

    #onConnectionError(error: ServerError): void {
        this.#lastError = error;
        if (error.retryAfterMs !== undefined) {
            this.#lastHintMs = error.retryAfterMs;
        }
        if (error.code === "token_expired") {
            // The close (4401) follows: with a hook, it becomes a reconnect with a fresh token.
            this.#tokenExpired = true;
        }
        if (error.code === "rate_limited") {
            // The frame that passed the rate is unknown: hold back every waiting one.
            for (const waiting of this.#outbox.values()) {
                this.#scheduleResend(waiting, error.retryAfterMs ?? DEFAULT_RETRY_AFTER_MS);
            }
        }
        this.#log("warn", `connection error: ${error.message}`);
    }

    #onBare(message: JsonObject): void {
        const kind = asString(message.type);
        if (kind === "error") {
            this.#onError(asObject(message.data), undefined);
            return;
        }
        if (kind === "tokenRefreshed") {
            const data = asObject(message.data);
            this.#log("info", "token refreshed");
            // The socket lives on under the new token: refresh again before it expires.
            this.#scheduleTokenRefresh(asInt(data.expiresAt));
            this.#listeners.emit("tokenRefreshed", data);
            return;
        }
        if (kind !== "heartbeat" && kind !== "welcome") {
            this.#log("debug", `ignored bare frame ${stringify(message).slice(0, 200)}`);
        }
    }

    #log(level: keyof AgentLogger, message: string): void {
        this.#logger[level]?.(message);
    }
}

function streamKey(conversationId: string, streamId: string): string {
    return `${conversationId}\u0000${streamId}`;
}

function newOutgoing(
    clientId: string,
    text: string,
    conversationId: string,
    runtimeWritten: Runtime | undefined,
): Outgoing {
    let resolve: (frame: JsonObject) => void = () => undefined;
    let reject: (error: unknown) => void = () => undefined;
    const settled = new Promise<JsonObject>((resolveSettled, rejectSettled) => {
        resolve = resolveSettled;
        reject = rejectSettled;
    });
    // Its waiter may be gone (timed out): a later rejection must not count as unhandled.
    settled.catch(() => undefined);
    return {
        clientId,
        text,
        conversationId,
        runtimeWritten,
        settled,
        resolve,
        reject,
        timer: undefined,
    };
}
