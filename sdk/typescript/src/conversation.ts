// End users: one conversation per connection, sends kept until acked, frames seen once.
//
//     const conversation = new Conversation("http://127.0.0.1:8080", token);
//     await conversation.connect();
//     const ack = await conversation.sendText("hello");
//     for await (const message of conversation.messages()) console.log(message.seq, message.text);
//
// Keyed sends are resent under their clientId until acked, across reconnects; every persistent
// frame is surfaced once (de-duplicated by seq); streamed answers are assembled with each chunk
// applied once. Browsers can use the callback form, `conversation.on("message", …)`.

import { StreamAssembly, type StreamUpdate } from "./assembly.js";
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
    RESENT_CODES,
    ServerError,
} from "./errors.js";
import {
    type Ack,
    type ConversationEvent,
    type ForwardedType,
    type Interrupt,
    isForwardedType,
    type Message,
    parseAck,
    parseConversationEvent,
    parseMessage,
    parseStreamChunk,
    parseStreamEnd,
    parseWelcome,
    type Welcome,
} from "./frames.js";
import { AsyncQueue, ChangeSignal, Listeners, sleep, waitUntil, within } from "./internal.js";
import { asObject, asString, byteLength, type JsonObject, stringify } from "./json.js";
import { type FrameLike, frameOf, isValidClientId, randomHex } from "./shapes.js";
import { SeqTracker } from "./tracking.js";

/** How often the outbox is checked for sends to write again, in ms. */
export const RESEND_TICK_MS = 50;
const DEFAULT_SEND_TIMEOUT_MS = 60_000;
const DEFAULT_FORWARD_TIMEOUT_MS = 10_000;

export interface ConversationOptions {
    /** An existing conversation of the token's user (for a token not bound to one). */
    conversationId?: string;
    /** The user of a new conversation, when the token names none. */
    userId?: string;
    /** The highest seq already seen (0: nothing); what follows is replayed. */
    watermark?: number;
    backoff?: Backoff;
    /** A send without an answer for this long is written again (default 5 s). */
    resendIntervalMs?: number;
    /** Bound of each connection attempt's upgrade and welcome (default 10 s). */
    openTimeoutMs?: number;
    /** Unread events and unread stream updates kept at most (the oldest go first). */
    maxEvents?: number;
    /** The WebSocket constructor (default: the platform's, else the `ws` package). */
    WebSocket?: WebSocketConstructor;
    /**
     * Gives a new token when the server refused or closed the connection for an expired
     * token; the client then reconnects with it instead of stopping for good.
     */
    refreshToken?: () => Promise<string> | string;
}

/** How long a keyed send is waited for, and how to give up on it early. */
export interface ConversationAckOptions {
    /** How long to wait for the ack (default 60 s); then AckTimeout, and no more resends. */
    timeoutMs?: number;
    /** Aborting gives up on the send (no more resends) and rejects with the signal's reason. */
    signal?: AbortSignal;
}

export interface ConversationSendOptions extends ConversationAckOptions {
    /** The send's clientId (default: the frame's own, else a fresh one). */
    clientId?: string;
}

export interface SendTextOptions extends ConversationSendOptions {
    metadata?: JsonObject;
    /** Another turn policy than the channel's for this send, where allowed (§3.10). */
    turnPolicy?: string;
}

export interface TurnTarget extends ConversationAckOptions {
    /** The turn's seq (default: the user's latest turn). */
    seq?: number;
    /** The turn's message id, when the seq is not known. */
    messageId?: string;
    clientId?: string;
}

export interface StopOptions extends ConversationAckOptions {
    /** The running turn to stop (default: the conversation's latest unanswered turn). */
    seq?: number;
    clientId?: string;
}

export interface ForwardOptions {
    clientId?: string;
    /** How long to wait for a connection before writing (default 10 s). */
    timeoutMs?: number;
}

export interface ConnectionState {
    readonly connected: boolean;
    readonly connections: number;
}

/** What {@link Conversation.on} can listen to, and what each handler gets. */
export interface ConversationListeners {
    message: Message;
    streamUpdate: StreamUpdate;
    event: ConversationEvent;
    state: ConnectionState;
    ack: Ack;
    /** The conversation stopped for good (a FatalClose or GaveUp), or was closed (undefined). */
    stopped: ConvergerError | undefined;
}

interface PendingSend {
    readonly clientId: string;
    readonly text: string;
    readonly promise: Promise<Ack>;
    readonly resolve: (ack: Ack) => void;
    readonly reject: (error: unknown) => void;
    /** Counts against maxInFlight (message sends; edit, regenerate and stop do not). */
    readonly queued: boolean;
    /** The connection it was last written on, counted as `#connections` (-1: to be written). */
    generation: number;
    lastSent: number;
    retryAt: number | undefined;
}

function noop(): void {}

/**
 * An end user's connection to one conversation.
 *
 * `url` is the node's base URL (`http://host:port`) or its WebSocket endpoint; `token` a
 * conversation-scope token: bound to a conversation, or unbound with `conversationId` (an
 * existing conversation of the token's user) or without (a new conversation is created).
 *
 * The client reconnects by itself (full-jitter backoff, honouring `retryAfterMs`; never after
 * 4400, 4401, 4403 or 1009, except that an expired token is renewed through the `refreshToken`
 * option) with the watermark so far, resends every unacked send with its clientId (an already
 * stored send is acked with `duplicate: true`), and surfaces every persistent frame once.
 * Frames this client sent itself are answered by the Ack that `send` returns and are not
 * surfaced again; frames of the same user sent from elsewhere are.
 *
 * `messages()`, `events()` and `streamUpdates()` read one shared queue each (two loops over
 * `messages()` split the messages between them); `on()` hands every item to every handler.
 */
export class Conversation {
    readonly #url: string;
    #token: string;
    #conversationId: string | undefined;
    readonly #requestedUserId: string | undefined;
    readonly #tracker: SeqTracker;
    readonly #backoff: Backoff;
    readonly #resendIntervalMs: number;
    readonly #openTimeoutMs: number;
    readonly #WebSocket: WebSocketConstructor | undefined;
    readonly #refreshHook: (() => Promise<string> | string) | undefined;

    readonly #outbox = new Map<string, PendingSend>();
    readonly #messages = new AsyncQueue<Message>();
    readonly #events: AsyncQueue<ConversationEvent>;
    readonly #streamUpdates: AsyncQueue<StreamUpdate>;
    readonly #streams = new StreamAssembly();
    readonly #listeners = new Listeners<ConversationListeners>((kind, error) => {
        console.error(`converger: a "${String(kind)}" handler failed`, error);
    });
    /** Notified on every connection change (welcomed, lost, closed, stopped). */
    readonly #changed = new ChangeSignal();
    readonly #lifetime = new AbortController();

    #connection: Connection | undefined;
    #welcome: Welcome | undefined;
    #connections = 0;
    #closed = false;
    #closing: Promise<void> | undefined;
    #connecting: Promise<Welcome> | undefined;
    #fatal: ConvergerError | undefined;
    #lastError: ServerError | undefined;
    #lastHintMs: number | undefined;
    #lastDisconnect: Disconnect | undefined;
    #connectedAt: number | undefined;
    #ticker: ReturnType<typeof setInterval> | undefined;
    /** The server refused the token as expired: renew it before the next attempt. */
    #tokenExpired = false;

    constructor(url: string, token: string, options: ConversationOptions = {}) {
        this.#url = wsUrl(url);
        this.#token = token;
        this.#conversationId = options.conversationId;
        this.#requestedUserId = options.userId;
        this.#tracker = new SeqTracker(options.watermark ?? 0);
        this.#backoff = options.backoff ?? new Backoff();
        this.#resendIntervalMs = options.resendIntervalMs ?? 5000;
        this.#openTimeoutMs = options.openTimeoutMs ?? DEFAULT_OPEN_TIMEOUT_MS;
        this.#WebSocket = options.WebSocket;
        this.#refreshHook = options.refreshToken;
        const maxEvents = options.maxEvents ?? 1000;
        this.#events = new AsyncQueue(maxEvents);
        this.#streamUpdates = new AsyncQueue(maxEvents);
    }

    // --- state ---------------------------------------------------------------------------

    /** The latest `welcome` (replaced on every reconnect); undefined before the first. */
    get welcome(): Welcome | undefined {
        return this.#welcome;
    }

    /** The conversation this client is in (known after the first `welcome`). */
    get conversationId(): string | undefined {
        return this.#conversationId;
    }

    /** The conversation's user. */
    get userId(): string | undefined {
        return this.#welcome?.userId ?? this.#requestedUserId;
    }

    /** The highest seq with nothing missing below it; store it to resume later. */
    get watermark(): number {
        return this.#tracker.watermark;
    }

    /** Open interrupts as of the latest `welcome`. */
    get pendingInterrupts(): Interrupt[] {
        return [...(this.#welcome?.pending ?? [])];
    }

    /** The conversation's streamed answers as assembled so far, across reconnects. */
    get streams(): StreamAssembly {
        return this.#streams;
    }

    /** How the last connection ended (undefined while the first one is open). */
    get lastDisconnect(): Disconnect | undefined {
        return this.#lastDisconnect;
    }

    /** Whether a welcomed connection is open right now. */
    get connected(): boolean {
        return this.#connection !== undefined;
    }

    /** `Date.now()` when the current (or last) connection was welcomed. */
    get connectedAt(): number | undefined {
        return this.#connectedAt;
    }

    /** How many connections were welcomed so far (1 after `connect()`). */
    get connections(): number {
        return this.#connections;
    }

    /** ClientIds of the sends still waiting for an ack, in send order. */
    get unacked(): string[] {
        return [...this.#outbox.keys()];
    }

    /** Why the conversation stopped for good, once it did. */
    get stoppedBy(): ConvergerError | undefined {
        return this.#fatal;
    }

    /**
     * Waits until a connection is open and at least `connections` were welcomed so far
     * (`connections: conversation.connections + 1` waits for the next reconnect).
     */
    async waitConnected(
        options: { timeoutMs?: number; connections?: number } = {},
    ): Promise<Welcome> {
        const timeoutMs = options.timeoutMs ?? this.#openTimeoutMs;
        const wanted = options.connections ?? 1;
        return waitUntil(
            this.#changed,
            () => {
                if (this.#fatal !== undefined) {
                    throw this.#fatal;
                }
                if (this.#closed) {
                    throw new ClientClosed("the conversation is closed");
                }
                const connected = this.#connection !== undefined && this.#connections >= wanted;
                return connected ? this.#welcome : undefined;
            },
            timeoutMs,
            () => new ConvergerError(`not connected within ${timeoutMs} ms`),
        );
    }

    // --- listening -----------------------------------------------------------------------

    /**
     * Calls `handler` with every item of `kind` from now on; returns the function that stops it.
     * Handlers run synchronously in arrival order; an exception in one is logged, not rethrown.
     */
    on<Kind extends keyof ConversationListeners>(
        kind: Kind,
        handler: (value: ConversationListeners[Kind]) => void,
    ): () => void {
        return this.#listeners.on(kind, handler);
    }

    // --- lifecycle -----------------------------------------------------------------------

    /**
     * Opens the first connection (one attempt; an expired token is renewed once through the
     * `refreshToken` option); later ones are made in the background. Throws FatalClose when
     * the node refuses the hello for good and GaveUp when it cannot be reached.
     */
    connect(): Promise<Welcome> {
        if (this.#welcome !== undefined && this.#fatal === undefined && !this.#closed) {
            return Promise.resolve(this.#welcome);
        }
        // Concurrent calls share one attempt; after a failed one, a later call tries again.
        this.#connecting ??= this.#connectOnce().finally(() => {
            this.#connecting = undefined;
        });
        return this.#connecting;
    }

    /** Creates a conversation with `options` and connects it. */
    static async open(
        url: string,
        token: string,
        options: ConversationOptions = {},
    ): Promise<Conversation> {
        const conversation = new Conversation(url, token, options);
        await conversation.connect();
        return conversation;
    }

    async #connectOnce(): Promise<Welcome> {
        if (this.#closed) {
            throw new ClientClosed("the conversation is closed");
        }
        if (this.#fatal !== undefined) {
            // Stopped for good: a new connection would meet the same refusal (and a second
            // supervisor and ticker would run beside the stopped ones).
            throw this.#fatal;
        }
        let opened: OpenedSession;
        try {
            opened = await this.#open();
        } catch (error) {
            if (
                error instanceof FatalClose &&
                error.tokenExpired &&
                this.#refreshHook !== undefined
            ) {
                await this.#renewToken();
                opened = await this.#open();
            } else {
                throw error;
            }
        }
        if (this.#closed) {
            opened.connection.close(1000);
            throw new ClientClosed("the conversation was closed while connecting");
        }
        this.#attach(opened);
        this.#ticker = setInterval(() => this.#tick(), RESEND_TICK_MS);
        void this.#supervise();
        return this.#requireWelcome();
    }

    #requireWelcome(): Welcome {
        if (this.#welcome === undefined) {
            throw new ConvergerError("the conversation is not connected");
        }
        return this.#welcome;
    }

    #openSession(): Promise<OpenedSession> {
        return openSession(this.#url, this.#hello(), {
            timeoutMs: this.#openTimeoutMs,
            WebSocket: this.#WebSocket,
            signal: this.#lifetime.signal,
        });
    }

    /** One attempt of connect(): an unreachable node is GaveUp there, not a ConnectFailed. */
    #open(): Promise<OpenedSession> {
        return this.#openSession().catch((error: unknown) => {
            throw error instanceof ConnectFailed ? new GaveUp(1, error) : error;
        });
    }

    /**
     * Waits up to `timeoutMs` (default 5 s) for unacked sends, then closes (1000). Sends still
     * unacked then fail with ClientClosed; the iterators end.
     */
    close(options: { timeoutMs?: number } = {}): Promise<void> {
        this.#closing ??= this.#closeOnce(options.timeoutMs ?? 5000);
        return this.#closing;
    }

    async #closeOnce(timeoutMs: number): Promise<void> {
        const deadline = Date.now() + Math.max(timeoutMs, 0);
        while (
            this.#outbox.size > 0 &&
            this.#fatal === undefined &&
            this.#connections > 0 &&
            Date.now() < deadline
        ) {
            // Wakes at the next settled send (ack or refusal), or at the deadline.
            const settled = [...this.#outbox.values()].map((entry) =>
                entry.promise.then(noop, noop),
            );
            await Promise.race([...settled, sleep(deadline - Date.now(), this.#lifetime.signal)]);
        }
        this.#closed = true;
        this.#lifetime.abort();
        const connection = this.#connection;
        this.#detach();
        connection?.close(1000);
        this.#stopTicker();
        this.#failOutbox(
            new ClientClosed("the conversation was closed before the server answered"),
        );
        this.#endIterators();
        // A waitConnected() during a reconnect has no connection to see go: wake it to throw now.
        this.#changed.notify();
        if (this.#fatal === undefined) {
            this.#listeners.emit("stopped", undefined);
        }
    }

    #stopTicker(): void {
        if (this.#ticker !== undefined) {
            clearInterval(this.#ticker);
            this.#ticker = undefined;
        }
    }

    // --- reading -------------------------------------------------------------------------

    /**
     * Every persistent frame of the conversation once, across reconnects, until closed. Throws
     * the FatalClose or GaveUp at the end when the connection stopped for good.
     */
    async *messages(): AsyncGenerator<Message, void, undefined> {
        for (;;) {
            const result = await this.#messages.next();
            if (result.done) {
                if (this.#fatal !== undefined) {
                    throw this.#fatal;
                }
                return;
            }
            yield result.value;
        }
    }

    /** The next persistent frame (see `messages()`); ClientClosed at the end. */
    async nextMessage(options: { timeoutMs?: number } = {}): Promise<Message> {
        const timeoutMs = options.timeoutMs ?? 10_000;
        const result = await this.#messages.nextWithin(timeoutMs);
        if (result === "timeout") {
            throw new ConvergerError(`no message within ${timeoutMs} ms`);
        }
        if (result.done) {
            throw this.#fatal ?? new ClientClosed("the conversation is closed");
        }
        return result.value;
    }

    /**
     * Streamed answers as they arrive: each chunk applied once, then each stream's end (from its
     * `streamEnd` or from the stored answer naming it, whichever arrives first).
     */
    async *streamUpdates(): AsyncGenerator<StreamUpdate, void, undefined> {
        for (;;) {
            const result = await this.#streamUpdates.next();
            if (result.done) {
                return;
            }
            yield result.value;
        }
    }

    /** Transient frames and connection events, typed (see ConversationEvent). */
    async *events(): AsyncGenerator<ConversationEvent, void, undefined> {
        for (;;) {
            const result = await this.#events.next();
            if (result.done) {
                return;
            }
            yield result.value;
        }
    }

    // --- sending -------------------------------------------------------------------------

    /**
     * Stores a message frame (`text`, `event`, any type with `data`) as the user; a string is a
     * `text` frame. The frame is resent with its clientId, across reconnects, until acked;
     * retryable refusals are resent after their `retryAfterMs`. Resolves with the ack; rejects
     * with the ServerError of a refusal, or AckTimeout.
     */
    send(frame: FrameLike, options: ConversationSendOptions = {}): Promise<Ack> {
        const body = frameOf(frame);
        const clientId = options.clientId ?? asString(body.clientId) ?? `c-${randomHex()}`;
        body.clientId = clientId;
        return this.#submit(clientId, body, true, options);
    }

    /** Sends a `text` message (see `send`). */
    sendText(text: string, options: SendTextOptions = {}): Promise<Ack> {
        const frame: JsonObject = { type: "text", data: { text } };
        if (options.metadata !== undefined) {
            frame.metadata = { ...options.metadata };
        }
        if (options.turnPolicy !== undefined) {
            frame.turnPolicy = options.turnPolicy;
        }
        return this.send(frame, options);
    }

    /**
     * Edits one of the user's turns (`seq`, else `messageId`, else the latest) with new `data`
     * (a string means `{text}`). The ack's `turn` names the new revision.
     */
    edit(data: string | JsonObject, target: TurnTarget = {}): Promise<Ack> {
        const body: JsonObject = {
            type: "edit",
            data: typeof data === "string" ? { text: data } : { ...data },
        };
        return this.#submitTurnFrame(body, "e", target);
    }

    /** Asks for another answer to a turn (`seq`, else `messageId`, else the latest). */
    regenerate(target: TurnTarget = {}): Promise<Ack> {
        return this.#submitTurnFrame({ type: "regenerate" }, "g", target);
    }

    /**
     * Stops the running turn (`seq`, else the latest unanswered one; docs/protocol.md §3.9).
     * The ack says whether it is stopping now (`stopped`) and names the `turn`.
     */
    stop(options: StopOptions = {}): Promise<Ack> {
        return this.#submitTurnFrame({ type: "stop" }, "s", options);
    }

    #submitTurnFrame(body: JsonObject, prefix: string, target: TurnTarget): Promise<Ack> {
        if (target.seq !== undefined) {
            body.seq = target.seq;
        }
        if (target.messageId !== undefined) {
            body.messageId = target.messageId;
        }
        const clientId = target.clientId ?? `${prefix}-${randomHex()}`;
        body.clientId = clientId;
        return this.#submit(clientId, body, false, target);
    }

    /** Tells the agents whether the user types (transient); false when not written. */
    typing(isTyping = true): boolean {
        return this.#write({ type: "typing", isTyping });
    }

    /** Stores the user's read position (default: the watermark); transient, no answer. */
    read(watermark?: number): boolean {
        return this.#write({ type: "read", watermark: watermark ?? this.#tracker.watermark });
    }

    /**
     * Hands a frame to the channel's agents (transient, not stored): `resume`, `abort`,
     * `genui_event`, `client_tools`, `client_skills` or `survey`. Waits for a connection, writes
     * the frame once and returns its clientId; without a connected agent the server answers
     * `bot_unavailable`, which `events()` yields as an ErrorEvent with this clientId.
     */
    async forward(
        type: ForwardedType,
        data: JsonObject = {},
        options: ForwardOptions = {},
    ): Promise<string> {
        if (!isForwardedType(type)) {
            throw new TypeError(`${String(type)} is not a forwarded frame type`);
        }
        const clientId = options.clientId ?? `f-${randomHex()}`;
        await this.waitConnected({ timeoutMs: options.timeoutMs ?? DEFAULT_FORWARD_TIMEOUT_MS });
        this.#write({ type, clientId, data: { ...data } });
        return clientId;
    }

    /** Forwards a `resume` (the answer to an interrupt) to the agents; see `forward`. */
    resume(data: JsonObject, options: ForwardOptions = {}): Promise<string> {
        return this.forward("resume", data, options);
    }

    /** Forwards an `abort` to the agents; see `forward`. */
    abort(data: JsonObject = {}, options: ForwardOptions = {}): Promise<string> {
        return this.forward("abort", data, options);
    }

    /** Uses `token` from now on: sent as `auth` now and in later hellos. */
    refreshToken(token: string): boolean {
        this.#token = token;
        return this.#write({ type: "auth", token });
    }

    async #submit(
        clientId: string,
        body: JsonObject,
        queued: boolean,
        options: ConversationAckOptions,
    ): Promise<Ack> {
        options.signal?.throwIfAborted();
        if (!isValidClientId(clientId)) {
            throw new TypeError(
                `invalid clientId ${JSON.stringify(clientId)} (1-128 of A-Za-z0-9._:~-)`,
            );
        }
        if (this.#fatal !== undefined) {
            throw this.#fatal;
        }
        if (this.#closed) {
            throw new ClientClosed("the conversation is closed");
        }
        const text = stringify(body);
        const limit = this.#welcome?.limits.maxFrameBytes;
        const size = byteLength(text);
        if (limit !== undefined && size > limit) {
            throw new FrameTooLarge(size, limit);
        }
        let entry = this.#outbox.get(clientId);
        if (entry === undefined) {
            let resolve: (ack: Ack) => void = () => {};
            let reject: (error: unknown) => void = () => {};
            const promise = new Promise<Ack>((resolvePromise, rejectPromise) => {
                resolve = resolvePromise;
                reject = rejectPromise;
            });
            entry = {
                clientId,
                text,
                promise,
                resolve,
                reject,
                queued,
                generation: -1,
                lastSent: 0,
                retryAt: undefined,
            };
            this.#outbox.set(clientId, entry);
            this.#pump();
        }
        const waited = options.timeoutMs ?? DEFAULT_SEND_TIMEOUT_MS;
        const pending = entry;
        const withdraw = (reason: unknown): void => {
            if (this.#outbox.get(clientId) === pending) {
                this.#outbox.delete(clientId); // no longer resent
                pending.reject(reason);
            }
        };
        const onAbort = (): void => withdraw(options.signal?.reason);
        options.signal?.addEventListener("abort", onAbort, { once: true });
        try {
            return await within(pending.promise, waited, () => new AckTimeout(clientId, waited));
        } catch (error) {
            if (error instanceof AckTimeout) {
                withdraw(error);
            }
            throw error;
        } finally {
            options.signal?.removeEventListener("abort", onAbort);
        }
    }

    /** Writes the sends not yet on the current connection, within `maxInFlight`. */
    #pump(): void {
        const connection = this.#connection;
        if (connection === undefined) {
            return;
        }
        const now = Date.now();
        const limit = this.#welcome?.limits.maxInFlight ?? 32;
        let inFlight = 0;
        for (const entry of this.#outbox.values()) {
            if (entry.queued && entry.generation === this.#connections) {
                inFlight += 1;
            }
        }
        for (const entry of this.#outbox.values()) {
            if (entry.generation === this.#connections) {
                continue;
            }
            if (entry.retryAt !== undefined && now < entry.retryAt) {
                continue;
            }
            if (entry.queued) {
                if (inFlight >= limit) {
                    break;
                }
                inFlight += 1;
            }
            this.#transmit(entry);
        }
    }

    #transmit(entry: PendingSend): void {
        entry.generation = this.#connections;
        entry.retryAt = undefined;
        entry.lastSent = Date.now();
        this.#connection?.send(entry.text);
    }

    #write(frame: JsonObject): boolean {
        return this.#connection?.send(stringify(frame)) ?? false;
    }

    #failOutbox(error: unknown): void {
        for (const entry of [...this.#outbox.values()]) {
            this.#outbox.delete(entry.clientId);
            entry.reject(error);
        }
    }

    /** Resends sends that went unanswered, writes what waits, and watches for a dead network. */
    #tick(): void {
        const connection = this.#connection;
        if (connection === undefined) {
            return;
        }
        const heartbeatMs = this.#welcome?.limits.heartbeatIntervalMs ?? 25_000;
        if (connection.abandonIfSilent(heartbeatMs)) {
            return; // neither frames nor heartbeats for that long: the network is gone
        }
        const now = Date.now();
        for (const entry of this.#outbox.values()) {
            const stale =
                entry.generation === this.#connections &&
                now - entry.lastSent >= this.#resendIntervalMs;
            if (stale) {
                this.#transmit(entry);
            }
        }
        this.#pump();
    }

    // --- connection ----------------------------------------------------------------------

    #hello(): JsonObject {
        const hello: JsonObject = {
            type: "hello",
            protocol: "converger/1",
            token: this.#token,
            watermark: this.#tracker.watermark,
        };
        if (this.#conversationId !== undefined) {
            hello.conversationId = this.#conversationId;
        }
        if (this.#requestedUserId !== undefined) {
            hello.userId = this.#requestedUserId;
        }
        return hello;
    }

    #attach(opened: OpenedSession): void {
        const welcome = parseWelcome(opened.welcome);
        const asked = this.#conversationId;
        if (asked !== undefined && welcome.conversationId !== asked) {
            this.#tracker.reset(0); // another conversation: its seqs are not ours
        }
        if (welcome.watermark !== undefined && this.#tracker.watermark > welcome.watermark) {
            this.#tracker.reset(welcome.watermark); // refused as invalid_watermark; live after it
        }
        const reconnected = this.#welcome !== undefined;
        this.#welcome = welcome;
        this.#conversationId = welcome.conversationId ?? this.#conversationId;
        this.#connection = opened.connection;
        this.#connections += 1;
        this.#connectedAt = Date.now();
        this.#lastError = undefined;
        this.#lastHintMs = undefined;
        if (reconnected) {
            this.#emit({ kind: "reconnected", welcome });
        }
        for (const frame of opened.early) {
            this.#handleFrame(frame);
        }
        opened.connection.onMessage((frame) => this.#handleFrame(frame));
        this.#notifyState();
        this.#pump();
    }

    #notifyState(): void {
        this.#changed.notify();
        this.#listeners.emit("state", {
            connected: this.connected,
            connections: this.#connections,
        });
    }

    #detach(): void {
        if (this.#connection === undefined) {
            return;
        }
        this.#connection = undefined;
        this.#notifyState();
    }

    async #supervise(): Promise<void> {
        try {
            for (;;) {
                const connection = this.#connection;
                if (connection === undefined) {
                    return;
                }
                const closed = await connection.closed;
                this.#detach();
                if (this.#closed) {
                    return;
                }
                const hintMs = this.#afterClose(closed);
                await this.#reconnect(hintMs);
                if (this.#closed) {
                    return;
                }
            }
        } catch (error) {
            if (this.#closed) {
                return;
            }
            // A FatalClose or GaveUp, or a bug: stop loudly rather than hang.
            this.#stopForGood(
                error instanceof ConvergerError
                    ? error
                    : new ConvergerError(`the connection loop failed: ${String(error)}`, {
                          cause: error,
                      }),
            );
        }
    }

    /** Records how a connection ended; the server's delay hint. Throws for a fatal close. */
    #afterClose(closed: CloseInfo): number | undefined {
        this.#lastDisconnect = disconnectOf(closed, this.#lastHintMs);
        if (FATAL_CLOSE_CODES.has(closed.code)) {
            const fatal = new FatalClose(closed.code, closed.reason, this.#lastError);
            if (!(fatal.tokenExpired && this.#refreshHook !== undefined)) {
                throw fatal;
            }
            this.#tokenExpired = true;
        }
        return this.#lastDisconnect.retryAfterMs;
    }

    async #renewToken(): Promise<void> {
        const hook = this.#refreshHook;
        if (hook === undefined) {
            return;
        }
        const token = await within(
            Promise.resolve(hook()),
            this.#openTimeoutMs,
            () => new ConvergerError(`refreshToken gave no token within ${this.#openTimeoutMs} ms`),
        );
        this.#token = token;
        this.#tokenExpired = false;
    }

    async #reconnect(firstHintMs: number | undefined): Promise<void> {
        let attempt = 0;
        let hintMs = firstHintMs;
        for (;;) {
            await sleep(this.#backoff.delay(attempt, hintMs), this.#lifetime.signal);
            if (this.#closed) {
                return;
            }
            if (this.#tokenExpired) {
                await this.#renewToken();
            }
            let opened: OpenedSession;
            try {
                opened = await this.#openSession();
            } catch (error) {
                if (
                    error instanceof FatalClose &&
                    error.tokenExpired &&
                    this.#refreshHook !== undefined
                ) {
                    this.#tokenExpired = true;
                } else if (!(error instanceof ConnectFailed)) {
                    throw error;
                }
                attempt += 1;
                hintMs = error instanceof ConnectFailed ? error.retryAfterMs : undefined;
                if (this.#backoff.exhausted(attempt)) {
                    throw new GaveUp(attempt, error);
                }
                continue;
            }
            if (this.#closed) {
                opened.connection.close(1000);
                return;
            }
            this.#attach(opened);
            return;
        }
    }

    #stopForGood(error: ConvergerError): void {
        this.#fatal = error;
        this.#stopTicker();
        const connection = this.#connection;
        this.#detach();
        connection?.close(1000);
        this.#failOutbox(error);
        this.#notifyState();
        this.#endIterators();
        this.#listeners.emit("stopped", error);
    }

    #endIterators(): void {
        this.#messages.close();
        this.#events.close();
        this.#streamUpdates.close();
    }

    #emit(event: ConversationEvent): void {
        this.#events.push(event);
        this.#listeners.emit("event", event);
    }

    #emitUpdate(update: StreamUpdate): void {
        this.#streamUpdates.push(update);
        this.#listeners.emit("streamUpdate", update);
    }

    // --- receiving -----------------------------------------------------------------------

    /**
     * One frame, its failure contained: an exception here would escape into the socket's event
     * dispatch (an uncaught exception in Node) and lose the frames after it.
     */
    #handleFrame(frame: JsonObject): void {
        try {
            this.#onFrame(frame);
        } catch (error) {
            console.error(`converger: could not handle ${stringify(frame).slice(0, 200)}`, error);
        }
    }

    #onFrame(frame: JsonObject): void {
        const type = asString(frame.type) ?? "";
        const message = parseMessage(frame);
        if (message !== undefined) {
            this.#onPersistent(message);
            return;
        }
        switch (type) {
            case "ack":
                this.#onAck(parseAck(frame));
                return;
            case "error":
                this.#onError(asObject(frame.data), frame);
                return;
            case "heartbeat":
                if (this.#tracker.hasGap) {
                    this.#sync();
                }
                return;
            case "welcome":
                return;
            case "streamChunk":
                this.#onStreamChunk(frame);
                return;
            case "streamEnd":
                this.#onStreamEnd(frame);
                return;
        }
        const event = parseConversationEvent(frame);
        if (event === undefined) {
            return;
        }
        this.#emit(event);
        if (event.kind === "replayTruncated") {
            this.#sync();
        }
    }

    #onStreamChunk(frame: JsonObject): void {
        const chunk = parseStreamChunk(frame);
        if (chunk === undefined) {
            this.#emit({ kind: "unknown", raw: frame });
            return;
        }
        const stream = this.#streams.applyChunk(chunk);
        if (stream !== undefined) {
            this.#emitUpdate({ streamId: stream.streamId, stream, chunk });
        }
    }

    #onStreamEnd(frame: JsonObject): void {
        const end = parseStreamEnd(frame);
        if (end === undefined) {
            this.#emit({ kind: "unknown", raw: frame });
            return;
        }
        const stream = this.#streams.applyEnd(end);
        if (stream !== undefined) {
            this.#emitUpdate({ streamId: stream.streamId, stream, end });
        }
    }

    #onPersistent(message: Message): void {
        const entry =
            message.clientId === undefined ? undefined : this.#outbox.get(message.clientId);
        if (entry !== undefined) {
            // Our own send, replayed after a reconnect that lost its ack: it is stored.
            this.#tracker.observe(message.seq);
            this.#acked(entry, {
                clientId: message.clientId,
                id: message.id,
                seq: message.seq,
                timestamp: message.timestamp,
                duplicate: true,
                turn: undefined,
                stopped: undefined,
                raw: message.raw,
            });
            return;
        }
        if (!this.#tracker.observe(message.seq)) {
            return;
        }
        this.#messages.push(message);
        this.#listeners.emit("message", message);
        const ended = this.#streams.applyMessage(message);
        if (ended !== undefined) {
            this.#emitUpdate({
                streamId: ended.stream.streamId,
                stream: ended.stream,
                end: ended.end,
            });
        }
    }

    #onAck(ack: Ack): void {
        if (ack.seq !== undefined) {
            this.#tracker.observe(ack.seq);
        }
        if (ack.clientId === undefined) {
            return;
        }
        const entry = this.#outbox.get(ack.clientId);
        if (entry === undefined) {
            return; // a second ack of a send already settled (a resend crossed the first ack)
        }
        this.#acked(entry, ack);
    }

    /** Settles `entry` with `ack`; its place in flight goes to the next waiting send. */
    #acked(entry: PendingSend, ack: Ack): void {
        this.#outbox.delete(entry.clientId);
        entry.resolve(ack);
        this.#listeners.emit("ack", ack);
        this.#pump();
    }

    #onError(data: JsonObject, frame: JsonObject): void {
        const error = ServerError.fromData(data);
        const entry = error.clientId === undefined ? undefined : this.#outbox.get(error.clientId);
        const retryAt = Date.now() + (error.retryAfterMs ?? DEFAULT_RETRY_AFTER_MS);
        if (entry !== undefined) {
            if (RESENT_CODES.has(error.code)) {
                entry.generation = -1;
                entry.retryAt = retryAt;
                return;
            }
            this.#outbox.delete(entry.clientId);
            entry.reject(error);
            this.#pump();
            return;
        }
        if (error.code === "rate_limited") {
            // The dropped frame is not named: send again whatever is waiting, a bit later.
            for (const waiting of this.#outbox.values()) {
                waiting.generation = -1;
                waiting.retryAt = retryAt;
            }
        } else if (error.clientId === undefined) {
            // A connection-level error: it explains the close that usually follows.
            this.#lastError = error;
            this.#lastHintMs = error.retryAfterMs ?? this.#lastHintMs;
        }
        this.#emit({ kind: "error", error, raw: frame });
    }

    #sync(): void {
        this.#write({ type: "sync", watermark: this.#tracker.watermark });
    }
}
