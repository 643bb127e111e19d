// One WebSocket connection: the upgrade, `hello` / `welcome`, and reading a close.
//
// Both clients (end users and agents) share this; the reconnect loops live in each client.
// The socket is the platform's `WebSocket` (browsers, Node 22+) or, in older Node, the `ws`
// package, loaded on demand so that browser bundles never include it.

import { ClientClosed, ConnectFailed, FatalClose, ServerError } from "./errors.js";
import { asInt, asObject, asString, type JsonObject, parseObject, stringify } from "./json.js";

export const SOCKET_PATH = "/socket/converger/v1";
export const SUBPROTOCOL = "converger.v1";
/** Closes a new connection would get again: protocol, auth, inactive channel, too big. */
export const FATAL_CLOSE_CODES: ReadonlySet<number> = new Set([4400, 4401, 4403, 1009]);
/** The close code of a connection lost without a close frame. */
export const ABNORMAL_CLOSURE = 1006;
export const DEFAULT_OPEN_TIMEOUT_MS = 10_000;
/**
 * The node writes at least a heartbeat every `heartbeatIntervalMs`: silence for this many of them
 * (plus a slack) means the network path died without a close, and the connection is dropped.
 */
const SILENT_HEARTBEATS = 2;
const SILENCE_SLACK_MS = 5000;

/** How long a connection may stay silent before it counts as dead (see SILENT_HEARTBEATS). */
export function silenceLimitMs(heartbeatIntervalMs: number): number {
    return heartbeatIntervalMs * SILENT_HEARTBEATS + SILENCE_SLACK_MS;
}

/** The events this SDK reads from a socket; both the DOM `WebSocket` and `ws` provide them. */
export interface SocketEvent {
    readonly type: string;
    readonly data?: unknown;
    readonly code?: number;
    readonly reason?: string;
    readonly message?: string;
}

/** The part of the WebSocket API this SDK uses (the DOM's and the `ws` package's both fit). */
export interface WebSocketLike {
    readonly readyState: number;
    readonly bufferedAmount: number;
    send(data: string): void;
    close(code?: number, reason?: string): void;
    addEventListener(
        type: "open" | "message" | "close" | "error",
        listener: (event: SocketEvent) => void,
    ): void;
}

/** A WebSocket constructor: `globalThis.WebSocket`, the `ws` package's, or a test double. */
export type WebSocketConstructor = new (
    url: string,
    protocols?: string | string[],
) => WebSocketLike;

const OPEN = 1;

/**
 * The WebSocket endpoint for `url`.
 *
 * `http://host:port` (or `https`) becomes `ws://host:port/socket/converger/v1`; a `ws`/`wss` URL
 * without a path gets the path too; anything else is kept as given.
 */
export function wsUrl(url: string): string {
    const match = /^([A-Za-z][A-Za-z0-9+.-]*):\/\/([^/?#]*)([^?#]*)(.*)$/.exec(url);
    if (match === null) {
        return url;
    }
    const [, scheme = "", authority = "", path = "", rest = ""] = match;
    const lowered = scheme.toLowerCase();
    const wsScheme = lowered === "http" ? "ws" : lowered === "https" ? "wss" : scheme;
    const wsPath = path === "" || path === "/" ? SOCKET_PATH : path;
    return `${wsScheme}://${authority}${wsPath}${rest}`;
}

let wsPackage: Promise<WebSocketConstructor> | undefined;

/** The platform's WebSocket, else the `ws` package (Node before 22). */
export async function defaultWebSocket(): Promise<WebSocketConstructor> {
    const platform: unknown = Reflect.get(globalThis, "WebSocket");
    if (typeof platform === "function") {
        return platform as WebSocketConstructor;
    }
    wsPackage ??= import("ws").then((module) => module.WebSocket);
    return wsPackage;
}

/** `retryAfterMs` of a JSON close reason (1012, 4503). */
export function retryHintOfReason(reason: string): number | undefined {
    if (!reason.startsWith("{")) {
        const legacy = /retry_after_ms=(\d+)/.exec(reason);
        return legacy?.[1] === undefined ? undefined : Number(legacy[1]);
    }
    const parsed = parseObject(reason);
    return parsed === undefined ? undefined : asInt(parsed.retryAfterMs);
}

/** How a connection ended: the close the server sent (1006 when none). */
export interface CloseInfo {
    readonly code: number;
    readonly reason: string;
}

/** How the last connection ended. `code` is 1006 when no close frame arrived. */
export interface Disconnect {
    readonly code: number;
    readonly reason: string;
    /** The server's delay hint (from the JSON close reason or the `error` before it). */
    readonly retryAfterMs: number | undefined;
    /** `Date.now()` when the client noticed. */
    readonly at: number;
}

/**
 * How `close` ended a connection, noticed now; the delay hint is the close reason's, else
 * `earlierHintMs` (that of the connection-level `error` before it).
 */
export function disconnectOf(close: CloseInfo, earlierHintMs: number | undefined): Disconnect {
    return {
        code: close.code,
        reason: close.reason,
        retryAfterMs: retryHintOfReason(close.reason) ?? earlierHintMs,
        at: Date.now(),
    };
}

/**
 * A welcomed connection: frames arrive through {@link Connection.onMessage}, in order; frames
 * that arrive before a handler is set are buffered, so none is lost between `welcome` and the
 * caller's first read.
 */
export class Connection {
    readonly socket: WebSocketLike;
    /** Resolves when the socket closed, with the server's close (1006 when it sent none). */
    readonly closed: Promise<CloseInfo>;
    #handler: ((frame: JsonObject) => void) | undefined;
    #buffered: JsonObject[] = [];
    #closeInfo: CloseInfo | undefined;
    #lastReceived = Date.now();
    readonly #resolveClosed: (info: CloseInfo) => void;

    constructor(socket: WebSocketLike) {
        this.socket = socket;
        let resolveClosed: (info: CloseInfo) => void = () => {};
        this.closed = new Promise((resolve) => {
            resolveClosed = resolve;
        });
        this.#resolveClosed = (info) => {
            if (this.#closeInfo !== undefined) {
                return;
            }
            this.#closeInfo = info;
            resolveClosed(info);
        };
        socket.addEventListener("close", (event) => {
            this.#resolveClosed({
                code: event.code ?? ABNORMAL_CLOSURE,
                reason: event.reason ?? "",
            });
        });
        socket.addEventListener("message", (event) => {
            this.#lastReceived = Date.now();
            const frame = typeof event.data === "string" ? parseObject(event.data) : undefined;
            if (frame === undefined) {
                return;
            }
            if (this.#handler === undefined) {
                this.#buffered.push(frame);
                return;
            }
            this.#handler(frame);
        });
    }

    /** Whether the socket is open (a write may still be lost if it drops right after). */
    get open(): boolean {
        return this.#closeInfo === undefined && this.socket.readyState === OPEN;
    }

    /** `Date.now()` when the last message arrived (for the idle watchdog). */
    get lastReceived(): number {
        return this.#lastReceived;
    }

    /**
     * The silence watchdog: gives the connection up ({@link abandon}) when nothing arrived for
     * {@link silenceLimitMs} of `heartbeatIntervalMs`, the sign of a network path that died
     * without a close. True when it did.
     */
    abandonIfSilent(heartbeatIntervalMs: number): boolean {
        if (Date.now() - this.#lastReceived <= silenceLimitMs(heartbeatIntervalMs)) {
            return false;
        }
        this.abandon("no heartbeat");
        return true;
    }

    /** Sets the handler of every following frame, after handing it the buffered ones. */
    onMessage(handler: (frame: JsonObject) => void): void {
        this.#handler = handler;
        const buffered = this.#buffered;
        this.#buffered = [];
        for (const frame of buffered) {
            handler(frame);
        }
    }

    /** Buffers the following frames until the next {@link Connection.onMessage}. */
    detachHandler(): void {
        this.#handler = undefined;
    }

    /** Writes one text message; false when the socket is not open. */
    send(text: string): boolean {
        if (!this.open) {
            return false;
        }
        try {
            this.socket.send(text);
            return true;
        } catch {
            return false;
        }
    }

    /**
     * Gives the connection up at once, without waiting for a closing handshake that a dead
     * network would never complete: `closed` resolves now with 1006 and `reason`.
     */
    abandon(reason: string): void {
        this.#resolveClosed({ code: ABNORMAL_CLOSURE, reason });
        const terminate: unknown = Reflect.get(this.socket, "terminate");
        try {
            if (typeof terminate === "function") {
                terminate.call(this.socket); // the ws package: drop the TCP connection now
            } else {
                this.socket.close(4000, reason);
            }
        } catch {
            // already gone
        }
    }

    /** Starts the closing handshake (idempotent). */
    close(code = 1000, reason = ""): void {
        try {
            this.socket.close(code, reason);
        } catch {
            // already closing or closed
        }
    }
}

export interface OpenSessionOptions {
    /** Bound for the upgrade and, separately, for the `welcome` (default 10 s). */
    timeoutMs?: number;
    /** The WebSocket constructor (default {@link defaultWebSocket}). */
    WebSocket?: WebSocketConstructor;
    /**
     * The client's lifetime: aborting it (the client's close()) drops the handshake at once and
     * rejects with {@link ClientClosed}, so no socket outlives the client.
     */
    signal?: AbortSignal;
}

/** A welcomed connection, `welcome.data`, and the frames that came before the welcome. */
export interface OpenedSession {
    connection: Connection;
    welcome: JsonObject;
    early: JsonObject[];
}

/** The HTTP status of a refused upgrade, when the socket implementation names it. */
function refusedStatus(message: string | undefined): number | undefined {
    const match = /Unexpected server response: (\d{3})/.exec(message ?? "");
    return match?.[1] === undefined ? undefined : Number(match[1]);
}

/**
 * Upgrades, sends `hello` and waits for `welcome`.
 *
 * Throws {@link FatalClose} for refusals a new attempt would meet again (closes 4400, 4401, 4403,
 * 1009; an upgrade refused with a 4xx other than 408/429) and {@link ConnectFailed}, with the
 * server's delay hint when it gave one, for the others.
 */
export async function openSession(
    url: string,
    hello: JsonObject,
    options: OpenSessionOptions = {},
): Promise<OpenedSession> {
    const timeoutMs = options.timeoutMs ?? DEFAULT_OPEN_TIMEOUT_MS;
    const signal = options.signal;
    const WebSocketClass = options.WebSocket ?? (await defaultWebSocket());
    if (signal?.aborted === true) {
        throw new ClientClosed("closed before connecting");
    }
    let socket: WebSocketLike;
    try {
        socket = new WebSocketClass(url, [SUBPROTOCOL]);
    } catch (error) {
        throw new ConnectFailed(`cannot connect to ${url}: ${String(error)}`, undefined, {
            cause: error,
        });
    }
    const connection = new Connection(socket);
    return new Promise<OpenedSession>((resolve, reject) => {
        const early: JsonObject[] = [];
        let refusal: ServerError | undefined;
        let errorMessage: string | undefined;
        let settled = false;
        let phase = "upgrade";
        const finish = (outcome: () => void): void => {
            if (settled) {
                return;
            }
            settled = true;
            clearTimeout(timer);
            signal?.removeEventListener("abort", onAbort);
            outcome();
        };
        const onAbort = (): void => {
            finish(() => {
                connection.abandon("client closed");
                reject(new ClientClosed("closed while connecting"));
            });
        };
        signal?.addEventListener("abort", onAbort, { once: true });
        // On a timeout the peer is unresponsive: a closing handshake would only wait for it too.
        let timer = setTimeout(() => {
            finish(() => {
                connection.abandon("handshake timeout");
                reject(
                    new ConnectFailed(
                        `no ${phase === "upgrade" ? "upgrade" : "welcome"} within ${timeoutMs} ms`,
                    ),
                );
            });
        }, timeoutMs);
        socket.addEventListener("error", (event) => {
            errorMessage = event.message ?? errorMessage;
        });
        socket.addEventListener("open", () => {
            phase = "welcome";
            // The welcome gets its own bound, as the upgrade did.
            clearTimeout(timer);
            timer = setTimeout(() => {
                finish(() => {
                    connection.abandon("no welcome");
                    reject(new ConnectFailed(`no welcome within ${timeoutMs} ms`));
                });
            }, timeoutMs);
            connection.send(stringify(hello));
        });
        connection.onMessage((frame) => {
            const kind = asString(frame.type);
            if (kind === "welcome") {
                finish(() => {
                    // Later frames go to the caller's handler (buffered until it sets one).
                    connection.detachHandler();
                    resolve({ connection, welcome: asObject(frame.data), early });
                });
                return;
            }
            if (kind === "error" && !("conversationId" in frame)) {
                refusal = ServerError.fromData(frame.data);
                return;
            }
            early.push(frame);
        });
        void connection.closed.then(({ code, reason }) => {
            finish(() => {
                const status = refusedStatus(errorMessage);
                if (phase === "upgrade" && status !== undefined && status >= 400 && status < 500) {
                    if (status !== 408 && status !== 429) {
                        reject(new FatalClose(undefined, errorMessage ?? "", undefined, status));
                        return;
                    }
                }
                if (FATAL_CLOSE_CODES.has(code)) {
                    reject(new FatalClose(code, reason, refusal));
                    return;
                }
                const hint = retryHintOfReason(reason) ?? refusal?.retryAfterMs;
                const why =
                    phase === "upgrade"
                        ? `cannot connect to ${url}: ${errorMessage ?? `closed ${code}`}`
                        : `closed during the handshake: ${code} ${reason}`.trimEnd();
                reject(new ConnectFailed(why, hint, { cause: refusal }));
            });
        });
    });
}
