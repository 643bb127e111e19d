// The errors of the SDK. Everything thrown on purpose derives from ConvergerError:
// - ServerError is an `error` frame of the server (docs/protocol.md §7) refusing something this
//   client sent, with a subclass for the refusals a caller handles differently;
// - FatalClose ends a connection for good (a close or an upgrade refusal a new connection
//   would meet again);
// - RestError and its subclasses are the REST API's `{"error": {"code", "message"}}`;
// - AckTimeout, ClientClosed, GaveUp, FrameTooLarge, StreamInterrupted and ConnectFailed are
//   decided by the client itself.

import { asInt, asIntArray, asObject, asString, type JsonObject } from "./json.js";
import type { ErrorCode } from "./schema.js";

/** An error code of the contract, or another string a newer server (or an agent) sent. */
export type AnyErrorCode = ErrorCode | (string & {});

/**
 * Refusal codes after which a keyed send (a user's message, an agent's answer) is resent after
 * `retryAfterMs` instead of failing: the server stored nothing and asks to try again.
 */
export const RESENT_CODES: ReadonlySet<string> = new Set([
    "internal",
    "rate_limited",
    "too_many_in_flight",
    "unavailable",
]);
/** The wait before resending a refused frame when the refusal names no `retryAfterMs`. */
export const DEFAULT_RETRY_AFTER_MS = 1000;

/** Base class of every error this SDK throws on purpose. */
export class ConvergerError extends Error {
    constructor(message: string, options?: ErrorOptions) {
        super(message, options);
        this.name = new.target.name;
    }
}

/**
 * An `error` frame from the server, refusing a frame this client sent.
 *
 * The fields mirror the frame's `data`; `data` is the whole object. Use {@link ServerError.fromData}
 * to get the subclass the code names.
 */
export class ServerError extends ConvergerError {
    readonly code: AnyErrorCode;
    readonly serverMessage: string;
    readonly number: number | undefined;
    readonly retryable: boolean;
    readonly retryAfterMs: number | undefined;
    readonly details: JsonObject;
    readonly clientId: string | undefined;
    /** The refused frame's type, when the server named it. */
    readonly frameType: string | undefined;
    readonly data: JsonObject;

    constructor(data: JsonObject) {
        const code = asString(data.code) ?? "unknown";
        const serverMessage = asString(data.message) ?? "";
        const details = asObject(data.details);
        let text = serverMessage ? `${code}: ${serverMessage}` : code;
        if (Object.keys(details).length > 0) {
            text = `${text} ${JSON.stringify(details)}`;
        }
        super(text);
        this.data = { ...data };
        this.code = code;
        this.serverMessage = serverMessage;
        this.number = asInt(data.number);
        this.retryable = data.retryable === true;
        this.retryAfterMs = asInt(data.retryAfterMs);
        this.details = details;
        this.clientId = asString(data.clientId);
        this.frameType = asString(data.frameType);
    }

    /** The stream a refused `streamChunk` or `streamAbort` names (`details.streamId`). */
    get streamId(): string | undefined {
        return asString(this.details.streamId);
    }

    /** The index of the refused `streamChunk` (`details.index`), when given. */
    get index(): number | undefined {
        return asInt(this.details.index);
    }

    /** The error for an error frame's `data`, of the subclass its `code` names. */
    static fromData(data: unknown): ServerError {
        const fields = asObject(data);
        const Kind = SERVER_ERROR_CLASSES[asString(fields.code) ?? ""] ?? ServerError;
        return new Kind(fields);
    }
}

/** `turn_conflict`: another answer is already committed for this turn revision; drop the reply. */
export class TurnConflict extends ServerError {
    /** The seqs of the committed answer (`details.seqs`). */
    get committedSeqs(): number[] {
        return asIntArray(this.details.seqs);
    }
}

/** `turn_superseded`: the user edited or regenerated the turn; a newer revision exists. */
export class TurnSuperseded extends ServerError {
    /** The turn's latest revision (`details.revision`). */
    get latestRevision(): number | undefined {
        return asInt(this.details.revision);
    }
}

/** `stale_runtime`: the reply's `runtime.version` is not the conversation's current one. */
export class StaleRuntime extends ServerError {
    /** The conversation's current runtime version (`details.version`). */
    get currentVersion(): number | undefined {
        return asInt(this.details.version);
    }
}

/** `lease_lost` (lease mode): another worker claimed the turn since this delivery. */
export class LeaseLost extends ServerError {
    /** The turn's current fence (`details.fence`). */
    get currentFence(): number | undefined {
        return asInt(this.details.fence);
    }
}

/** `stream_closed`: a chunk for a stream that ended or that another connection writes. */
export class StreamClosed extends ServerError {}

/** `too_many_streams`: the connection has `maxStreamsPerConnection` streams open. */
export class TooManyStreams extends ServerError {}

/** `turn_stopped`: the end user stopped the turn and the gateway settled it. */
export class TurnStopped extends ServerError {}

/** `turn_in_progress`: the channel's turn policy is `reject` and a turn is running. */
export class TurnInProgress extends ServerError {
    /** The running turn's seq (`details.turn.seq`). */
    get runningSeq(): number | undefined {
        return asInt(asObject(this.details.turn).seq);
    }
}

const SERVER_ERROR_CLASSES: Partial<Record<string, new (data: JsonObject) => ServerError>> = {
    turn_conflict: TurnConflict,
    turn_superseded: TurnSuperseded,
    stale_runtime: StaleRuntime,
    lease_lost: LeaseLost,
    stream_closed: StreamClosed,
    too_many_streams: TooManyStreams,
    turn_stopped: TurnStopped,
    turn_in_progress: TurnInProgress,
};

/**
 * The connection ended in a way a new connection would meet again; no reconnect follows.
 *
 * `closeCode` is the WebSocket close code (4400 protocol, 4401 auth, 4403 channel inactive,
 * 1009 message too big), or undefined when the HTTP upgrade itself was refused with
 * `httpStatus`. `refusal` is the `error` frame that came before the close, if any.
 */
export class FatalClose extends ConvergerError {
    readonly closeCode: number | undefined;
    readonly reason: string;
    readonly refusal: ServerError | undefined;
    readonly httpStatus: number | undefined;

    constructor(
        closeCode: number | undefined,
        reason = "",
        refusal?: ServerError,
        httpStatus?: number,
    ) {
        let text =
            closeCode !== undefined
                ? `connection closed for good: ${closeCode} ${reason}`.trimEnd()
                : `upgrade refused with HTTP ${httpStatus} ${reason}`.trimEnd();
        if (refusal !== undefined) {
            text = `${text} (${refusal.message})`;
        }
        super(text, { cause: refusal });
        this.closeCode = closeCode;
        this.reason = reason;
        this.refusal = refusal;
        this.httpStatus = httpStatus;
    }

    /** Whether the server refused the token as expired (close 4401 after `token_expired`). */
    get tokenExpired(): boolean {
        if (this.refusal?.code === "token_expired") {
            return true;
        }
        if (
            this.refusal?.code === "unauthorized" &&
            this.refusal.details.reason === "token_expired"
        ) {
            return true;
        }
        return this.closeCode === 4401 && this.reason.includes("token_expired");
    }
}

/**
 * A connection attempt failed in a way a new attempt may fix: the node is unreachable, draining,
 * or refused the upgrade with a retryable status. `retryAfterMs` is the server's hint, if any.
 */
export class ConnectFailed extends ConvergerError {
    readonly retryAfterMs: number | undefined;

    constructor(message: string, retryAfterMs?: number, options?: ErrorOptions) {
        super(message, options);
        this.retryAfterMs = retryAfterMs;
    }
}

/** Reconnecting failed as many times in a row as the {@link Backoff} allows. */
export class GaveUp extends ConvergerError {
    readonly attempts: number;
    readonly lastError: unknown;

    constructor(attempts: number, lastError: unknown) {
        const why = lastError instanceof Error ? lastError.message : String(lastError);
        super(`gave up after ${attempts} failed connection attempts: ${why}`, { cause: lastError });
        this.attempts = attempts;
        this.lastError = lastError;
    }
}

/**
 * No ack (or refusal) arrived within the timeout; the frame is no longer resent.
 * It may still have been committed: a resend with the same clientId answers a duplicate ack.
 */
export class AckTimeout extends ConvergerError {
    readonly clientId: string;
    readonly timeoutMs: number;

    constructor(clientId: string, timeoutMs: number) {
        super(`no ack for ${clientId} within ${timeoutMs} ms`);
        this.clientId = clientId;
        this.timeoutMs = timeoutMs;
    }
}

/** The client was closed (or stopped for good) while this operation waited. */
export class ClientClosed extends ConvergerError {}

/** The frame is larger than the connection's `maxFrameBytes`; it was not sent. */
export class FrameTooLarge extends ConvergerError {
    readonly size: number;
    readonly limit: number;

    constructor(size: number, limit: number) {
        super(`frame of ${size} bytes is above maxFrameBytes (${limit})`);
        this.size = size;
        this.limit = limit;
    }
}

/**
 * A chunk could not be sent: the connection is down, or it dropped since the stream opened
 * (the server aborts an agent's open streams when its connection ends).
 */
export class StreamInterrupted extends ConvergerError {
    readonly conversationId: string;
    readonly streamId: string;

    constructor(conversationId: string, streamId: string, why: string) {
        super(`stream ${streamId} interrupted: ${why}`);
        this.conversationId = conversationId;
        this.streamId = streamId;
    }
}

/**
 * A REST call answered with an error status and `{"error": {"code", "message"}}`.
 *
 * `code` is `http_<status>` when the body has none; `retryAfterMs` comes from `Retry-After`.
 */
export class RestError extends ConvergerError {
    readonly status: number;
    readonly code: string;
    readonly serverMessage: string;
    readonly retryAfterMs: number | undefined;
    readonly body: unknown;

    constructor(
        status: number,
        code: string,
        serverMessage: string,
        retryAfterMs?: number,
        body?: unknown,
    ) {
        super(
            serverMessage ? `HTTP ${status} ${code}: ${serverMessage}` : `HTTP ${status} ${code}`,
        );
        this.status = status;
        this.code = code;
        this.serverMessage = serverMessage;
        this.retryAfterMs = retryAfterMs;
        this.body = body;
    }
}

/** 400 `bad_request` / `invalid_message`, 413 `payload_too_large`, 405, 426. */
export class InvalidRequestError extends RestError {}
/** 401: a missing or wrong credential (`unauthorized`, `token_expired`). */
export class AuthenticationError extends RestError {}
/** 403: `forbidden` or `channel_inactive`. */
export class PermissionDeniedError extends RestError {}
/** 404: `not_found` or `conversation_not_found` (foreign resources look missing). */
export class NotFoundError extends RestError {}
/** 409: `conversation_closed`. */
export class ConflictError extends RestError {}
/** 500 `internal`: a database failure; retrying may help. */
export class InternalServerError extends RestError {}
/** 503 `unavailable`: a database timeout or a draining node; see `retryAfterMs`. */
export class ServiceUnavailableError extends RestError {}

type RestErrorClass = new (
    status: number,
    code: string,
    serverMessage: string,
    retryAfterMs?: number,
    body?: unknown,
) => RestError;

/** The {@link RestError} subclass for an HTTP status. */
export function restErrorClass(status: number): RestErrorClass {
    switch (status) {
        case 401:
            return AuthenticationError;
        case 403:
            return PermissionDeniedError;
        case 404:
            return NotFoundError;
        case 409:
            return ConflictError;
        case 503:
            return ServiceUnavailableError;
        default:
            return status >= 500 ? InternalServerError : InvalidRequestError;
    }
}
