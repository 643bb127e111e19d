// Typed views of the frames the server sends (docs/protocol.md), built on the schema types.
//
// Every view keeps the decoded frame in `raw`, so fields this SDK does not model stay
// reachable; unknown fields are ignored, as the protocol asks. Parsers never throw: a frame
// that lacks what a view needs parses to `undefined` (and is surfaced as an UnknownFrame).

import { ServerError } from "./errors.js";
import {
    asBoolean,
    asInt,
    asIntArray,
    asObject,
    asString,
    asStringArray,
    isObject,
    type JsonObject,
} from "./json.js";
import type {
    Role,
    Limits as SchemaLimits,
    Participant as SchemaParticipant,
    ServerConversationAck2,
    ServerConversationStreamEnd,
} from "./schema.js";

/** Frame types that are never persistent messages, even when they carry a `seq`. */
export const SERVER_CONTROL_TYPES: ReadonlySet<string> = new Set([
    "welcome",
    "ack",
    "error",
    "heartbeat",
    "replayTruncated",
    "deliveryStatus",
    "presence",
    "tokenRefreshed",
    "typing",
    "run",
    "genui_components",
    "skills",
    "streamChunk",
    "streamEnd",
]);

/** Client frames the server hands to agents as sent (docs/protocol.md §3.2). */
export const FORWARDED_TYPES = [
    "resume",
    "abort",
    "genui_event",
    "client_tools",
    "client_skills",
    "survey",
] as const;
export type ForwardedType = (typeof FORWARDED_TYPES)[number];

/** Whether `type` is one of the {@link FORWARDED_TYPES}. */
export function isForwardedType(type: string): type is ForwardedType {
    return (FORWARDED_TYPES as readonly string[]).includes(type);
}

/** Who wrote or did something: `{"id": "alice", "role": "user"}`. */
export interface Participant {
    readonly id: SchemaParticipant["id"];
    readonly role: Role | (string & {});
}

/** A participant from its JSON object, or `undefined`. */
export function parseParticipant(value: unknown): Participant | undefined {
    const fields = asObject(value);
    const id = asString(fields.id);
    const role = asString(fields.role);
    return id === undefined || role === undefined ? undefined : { id, role };
}

/** A turn revision, `(seq, revision)`, as acks and refusals name it. */
export interface TurnRef {
    readonly seq: number;
    readonly revision: number;
}

/** From `{"seq": …, "revision": …}` (revision 0 when absent), or `undefined`. */
export function parseTurnRef(value: unknown): TurnRef | undefined {
    const fields = asObject(value);
    const seq = asInt(fields.seq);
    return seq === undefined ? undefined : { seq, revision: asInt(fields.revision) ?? 0 };
}

/** A conversation's runtime: a JSON `state` and its integer `version` (docs/protocol.md §5.6). */
export interface Runtime {
    readonly version: number;
    readonly state: JsonObject;
}

/** The runtime of a delivered turn's `meta.runtime` (`{version: 0, state: {}}` when absent). */
export function parseRuntime(value: unknown): Runtime {
    const fields = asObject(value);
    return { version: asInt(fields.version) ?? 0, state: { ...asObject(fields.state) } };
}

/**
 * A persistent frame: committed, with a gap-free per-conversation `seq`.
 *
 * `from` is `"user"` or `"bot"` relative to the end user; `clientId` is present on the viewing
 * user's own frames; `replaces` on an edit is the seq of the edited turn.
 */
export interface Message {
    readonly type: string;
    readonly id: string;
    readonly seq: number;
    readonly from: "user" | "bot" | undefined;
    readonly sender: Participant | undefined;
    readonly data: JsonObject;
    readonly timestamp: number | undefined;
    readonly metadata: JsonObject | undefined;
    readonly clientId: string | undefined;
    readonly replaces: number | undefined;
    /** `data.text` when it is a string (`text` frames). */
    readonly text: string | undefined;
    readonly raw: JsonObject;
}

/** A persistent frame, or `undefined` for anything without a `seq` or of a control type. */
export function parseMessage(frame: JsonObject): Message | undefined {
    const type = asString(frame.type);
    const seq = asInt(frame.seq);
    if (type === undefined || seq === undefined || SERVER_CONTROL_TYPES.has(type)) {
        return undefined;
    }
    const from = asString(frame.from);
    const data = asObject(frame.data);
    return {
        type,
        id: asString(frame.id) ?? "",
        seq,
        from: from === "user" || from === "bot" ? from : undefined,
        sender: parseParticipant(frame.sender),
        data,
        timestamp: asInt(frame.timestamp),
        metadata: isObject(frame.metadata) ? frame.metadata : undefined,
        clientId: asString(frame.clientId),
        replaces: asInt(frame.replaces),
        text: asString(data.text),
        raw: frame,
    };
}

/**
 * The server's ack of a keyed send (a message, `edit`, `regenerate`, `stop`, a proactive frame).
 *
 * `seq` and `id` are the stored frame's (absent for `regenerate` and `stop`, which store
 * nothing); `turn` is the revision an `edit` or `regenerate` opened, or the turn a `stop`
 * stopped; `stopped` answers a `stop`; `duplicate` is true when an earlier send with the same
 * clientId was already stored.
 */
export interface Ack {
    readonly clientId: ServerConversationAck2["clientId"] | undefined;
    readonly id: string | undefined;
    readonly seq: number | undefined;
    readonly timestamp: number | undefined;
    readonly duplicate: boolean;
    readonly turn: TurnRef | undefined;
    readonly stopped: boolean | undefined;
    readonly raw: JsonObject;
}

/** From an `ack` frame. */
export function parseAck(frame: JsonObject): Ack {
    return {
        clientId: asString(frame.clientId),
        id: asString(frame.id),
        seq: asInt(frame.seq),
        timestamp: asInt(frame.timestamp),
        duplicate: frame.duplicate === true,
        turn: parseTurnRef(frame.turn),
        stopped: asBoolean(frame.stopped),
        raw: frame,
    };
}

/** The ack of a turn's answer (`turnResult`): the stored frames' `seqs` and `ids`. */
export interface ReplyAck {
    readonly clientId: string | undefined;
    readonly turn: TurnRef | undefined;
    readonly ids: string[];
    readonly seqs: number[];
    readonly timestamp: number | undefined;
    readonly duplicate: boolean;
    readonly raw: JsonObject;
}

/** From an enveloped `ack` frame answering a `turnResult`. */
export function parseReplyAck(frame: JsonObject): ReplyAck {
    return {
        clientId: asString(frame.clientId),
        turn: parseTurnRef(frame.turn),
        ids: asStringArray(frame.ids),
        seqs: asIntArray(frame.seqs),
        timestamp: asInt(frame.timestamp),
        duplicate: frame.duplicate === true,
        raw: frame,
    };
}

/** The limits a `welcome` announces (the values the node enforces); defaults for missing keys. */
export type Limits = Required<Pick<SchemaLimits, AlwaysAnnouncedLimit>> &
    Pick<SchemaLimits, "maxConversations" | "maxStreamBytes" | "maxStreamsPerConnection">;

type AlwaysAnnouncedLimit =
    | "maxFrameBytes"
    | "maxTextBytes"
    | "maxMetadataBytes"
    | "maxInFlight"
    | "heartbeatIntervalMs"
    | "idleTimeoutMs"
    | "replayBatch"
    | "replayMax";

/** The server's default limits, used for keys a welcome leaves out. */
export const DEFAULT_LIMITS: Readonly<Record<AlwaysAnnouncedLimit, number>> = {
    maxFrameBytes: 65536,
    maxTextBytes: 16384,
    maxMetadataBytes: 4096,
    maxInFlight: 32,
    heartbeatIntervalMs: 25000,
    idleTimeoutMs: 60000,
    replayBatch: 200,
    replayMax: 1000,
};

/** From `welcome.data.limits`. */
export function parseLimits(value: unknown): Limits {
    const fields = asObject(value);
    const pick = (key: AlwaysAnnouncedLimit): number => asInt(fields[key]) ?? DEFAULT_LIMITS[key];
    return {
        maxFrameBytes: pick("maxFrameBytes"),
        maxTextBytes: pick("maxTextBytes"),
        maxMetadataBytes: pick("maxMetadataBytes"),
        maxInFlight: pick("maxInFlight"),
        heartbeatIntervalMs: pick("heartbeatIntervalMs"),
        idleTimeoutMs: pick("idleTimeoutMs"),
        replayBatch: pick("replayBatch"),
        replayMax: pick("replayMax"),
        maxConversations: asInt(fields.maxConversations),
        maxStreamBytes: asInt(fields.maxStreamBytes),
        maxStreamsPerConnection: asInt(fields.maxStreamsPerConnection),
    };
}

/** An open interrupt of a conversation (`welcome.data.pending`). */
export interface Interrupt {
    readonly id: string;
    readonly data: JsonObject;
}

/**
 * `welcome.data` of one connection.
 *
 * Channel scope (agents) has `channelId`, `group`, `since` and, in lease mode, `claim` and
 * `leaseMs`. Conversation scope (end users) has `conversationId`, `userId`, `watermark` (the
 * head when the session subscribed) and `pending` interrupts.
 */
export interface Welcome {
    readonly protocol: string | undefined;
    readonly scope: "conversation" | "channel" | undefined;
    readonly connectionId: string;
    readonly expiresAt: number | undefined;
    readonly limits: Limits;
    readonly capabilities: JsonObject;
    /** Whether the node supports streamed answers (`capabilities.streams`). */
    readonly streams: boolean;
    readonly channelId: string | undefined;
    readonly group: string | undefined;
    readonly since: number | undefined;
    readonly claim: string | undefined;
    readonly leaseMs: number | undefined;
    readonly conversationId: string | undefined;
    readonly userId: string | undefined;
    readonly watermark: number | undefined;
    readonly pending: Interrupt[];
    readonly raw: JsonObject;
}

/** From `welcome.data`. */
export function parseWelcome(data: unknown): Welcome {
    const fields = asObject(data);
    const pending: Interrupt[] = [];
    if (Array.isArray(fields.pending)) {
        for (const item of fields.pending) {
            const entry = asObject(item);
            const id = asString(entry.id);
            if (id !== undefined) {
                pending.push({ id, data: asObject(entry.data) });
            }
        }
    }
    const scope = asString(fields.scope);
    const capabilities = asObject(fields.capabilities);
    return {
        protocol: asString(fields.protocol),
        scope: scope === "conversation" || scope === "channel" ? scope : undefined,
        connectionId: asString(fields.connectionId) ?? "",
        expiresAt: asInt(fields.expiresAt),
        limits: parseLimits(fields.limits),
        capabilities,
        streams: capabilities.streams === true,
        channelId: asString(fields.channelId),
        group: asString(fields.group),
        since: asInt(fields.since),
        claim: asString(fields.claim),
        leaseMs: asInt(fields.leaseMs),
        conversationId: asString(fields.conversationId),
        userId: asString(fields.userId),
        watermark: asInt(fields.watermark),
        pending,
        raw: fields,
    };
}

/**
 * `streamChunk`: one chunk of an answer an agent is streaming (transient, never stored).
 *
 * `index` counts from 0 within the stream; a chunk carries `text` (a delta to append) or `chunk`
 * (a genui chunk object). A new connection is shown every open stream from index 0 again, each
 * run of text chunks coalesced into one chunk covering `firstIndex` to `index`: assemble with a
 * StreamAssembly, which applies each index once.
 */
export interface StreamChunk {
    readonly streamId: string;
    readonly index: number;
    readonly firstIndex: number;
    readonly turn: TurnRef | undefined;
    /** The writing agent (the wire's `from`). */
    readonly sender: Participant | undefined;
    readonly text: string | undefined;
    readonly chunk: JsonObject | undefined;
    readonly raw: JsonObject;
}

/** From a `streamChunk` frame; `undefined` when `streamId` or `index` is missing or bad. */
export function parseStreamChunk(frame: JsonObject): StreamChunk | undefined {
    const streamId = asString(frame.streamId);
    const index = asInt(frame.index);
    if (streamId === undefined || index === undefined || index < 0) {
        return undefined;
    }
    const firstIndex = asInt(frame.firstIndex) ?? index;
    if (firstIndex < 0 || firstIndex > index) {
        return undefined;
    }
    return {
        streamId,
        index,
        firstIndex,
        turn: parseTurnRef(frame.turn),
        sender: parseParticipant(frame.from),
        text: asString(frame.text),
        chunk: isObject(frame.chunk) ? frame.chunk : undefined,
        raw: frame,
    };
}

/**
 * `streamEnd`: a stream ended, `committed` (its answer is stored) or `aborted` (`reason` says
 * why). `raw` is the frame that ended the stream: the `streamEnd`, or the stored answer when a
 * StreamAssembly ended the stream on seeing it.
 */
export interface StreamEnd {
    readonly streamId: string;
    readonly status: ServerConversationStreamEnd["status"];
    readonly reason: string | undefined;
    readonly committed: boolean;
    readonly raw: JsonObject;
}

/** A StreamEnd from its parts. */
export function streamEnd(
    streamId: string,
    status: StreamEnd["status"],
    reason: string | undefined,
    raw: JsonObject,
): StreamEnd {
    return { streamId, status, reason, committed: status === "committed", raw };
}

/** From a `streamEnd` frame; `undefined` when `streamId` or `status` is missing. */
export function parseStreamEnd(frame: JsonObject): StreamEnd | undefined {
    const streamId = asString(frame.streamId);
    const status = frame.status;
    if (streamId === undefined || (status !== "committed" && status !== "aborted")) {
        return undefined;
    }
    return streamEnd(streamId, status, asString(frame.reason), frame);
}

// --- What an end user receives besides persistent frames ---------------------------------

/** `typing`: an agent (no `sender`) or another participant types or stopped. */
export interface Typing {
    readonly kind: "typing";
    readonly isTyping: boolean;
    readonly sender: Participant | undefined;
    readonly raw: JsonObject;
}

/** `run`: an agent's status frame, `data` as the agent sent it. */
export interface RunStatus {
    readonly kind: "run";
    readonly data: JsonObject;
    readonly raw: JsonObject;
}

/**
 * An `error` frame that does not answer a send of this client: an agent's relayed error
 * (`busy`, …), `bot_unavailable` for a forwarded frame, `invalid_watermark`, `token_expired`…
 */
export interface ErrorEvent {
    readonly kind: "error";
    readonly error: ServerError;
    readonly raw: JsonObject;
}

/** `deliveryStatus`: `by` has read up to `upToSeq`. */
export interface DeliveryStatus {
    readonly kind: "deliveryStatus";
    readonly upToSeq: number | undefined;
    readonly status: string | undefined;
    readonly by: Participant | undefined;
    readonly raw: JsonObject;
}

/** `presence` of a participant (per node): `online` or `offline`. */
export interface Presence {
    readonly kind: "presence";
    readonly participant: Participant | undefined;
    readonly status: string | undefined;
    readonly connections: number | undefined;
    readonly raw: JsonObject;
}

/** The connection was re-established: the replay and the resends follow. */
export interface Reconnected {
    readonly kind: "reconnected";
    readonly welcome: Welcome;
}

/** The replay stopped at `watermark` below `headSeq`; the client syncs the rest. */
export interface ReplayTruncated {
    readonly kind: "replayTruncated";
    readonly watermark: number | undefined;
    readonly headSeq: number | undefined;
    readonly raw: JsonObject;
}

/** A catalog the channel's agents published (`genui_components` or `skills`). */
export interface Catalog {
    readonly kind: "catalog";
    readonly catalog: "genui_components" | "skills";
    readonly hash: string | undefined;
    readonly unchanged: boolean;
    readonly raw: JsonObject;
}

/** `tokenRefreshed`: the token sent with `auth` was accepted. */
export interface TokenRefreshed {
    readonly kind: "tokenRefreshed";
    readonly expiresAt: number | undefined;
    readonly raw: JsonObject;
}

/**
 * `conversationUpdate`: the conversation's status changed (closed, reopened, …). Transient
 * for this SDK's purposes when it comes without a `seq`; a stored one is also a Message.
 */
export interface ConversationUpdate {
    readonly kind: "conversationUpdate";
    readonly data: JsonObject;
    readonly raw: JsonObject;
}

/** A frame of a type this SDK does not model. */
export interface UnknownFrame {
    readonly kind: "unknown";
    readonly raw: JsonObject;
}

/** Everything `Conversation.events()` yields, discriminated by `kind`. */
export type ConversationEvent =
    | Typing
    | RunStatus
    | ErrorEvent
    | DeliveryStatus
    | Presence
    | Reconnected
    | ReplayTruncated
    | Catalog
    | TokenRefreshed
    | ConversationUpdate
    | UnknownFrame;

/**
 * The event for a transient frame an end user received (anything but persistent frames, acks,
 * stream frames and `welcome`), or `undefined` for frames that are not events (`heartbeat`).
 */
export function parseConversationEvent(frame: JsonObject): ConversationEvent | undefined {
    const type = asString(frame.type) ?? "";
    const data = asObject(frame.data);
    switch (type) {
        case "heartbeat":
        case "welcome":
            return undefined;
        case "typing":
            return {
                kind: "typing",
                isTyping: frame.isTyping === true,
                sender: parseParticipant(frame.sender),
                raw: frame,
            };
        case "run":
            return { kind: "run", data, raw: frame };
        case "error":
            return { kind: "error", error: ServerError.fromData(data), raw: frame };
        case "deliveryStatus":
            return {
                kind: "deliveryStatus",
                upToSeq: asInt(data.upToSeq),
                status: asString(data.status),
                by: parseParticipant(data.by),
                raw: frame,
            };
        case "presence":
            return {
                kind: "presence",
                participant: parseParticipant(data.participant),
                status: asString(data.status),
                connections: asInt(data.connections),
                raw: frame,
            };
        case "replayTruncated":
            return {
                kind: "replayTruncated",
                watermark: asInt(data.watermark),
                headSeq: asInt(data.headSeq),
                raw: frame,
            };
        case "genui_components":
        case "skills":
            return {
                kind: "catalog",
                catalog: type,
                hash: asString(frame.hash),
                unchanged: frame.unchanged === true,
                raw: frame,
            };
        case "tokenRefreshed":
            return { kind: "tokenRefreshed", expiresAt: asInt(data.expiresAt), raw: frame };
        case "conversationUpdate":
            return { kind: "conversationUpdate", data, raw: frame };
        default:
            return { kind: "unknown", raw: frame };
    }
}
