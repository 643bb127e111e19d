// The REST API (docs/openapi.yaml) over `fetch`: what a browser needs (history pages, the
// conversation list, stopping a turn, token refresh) and what tools and tests need (tenants,
// channels, minting tokens). Every call is bounded by a timeout.

import { RestError, restErrorClass } from "./errors.js";
import { type Message, parseMessage } from "./frames.js";
import { asInt, asObject, asString, asStringArray, isObject, type JsonObject } from "./json.js";
import { type FrameLike, frameOf } from "./shapes.js";

/** A tenant; `apiKey` (`cvg_key_…`) is shown once, at creation. */
export interface Tenant {
    readonly id: string;
    readonly name: string;
    readonly apiKey: string;
}

/** A channel of a tenant; `secret` is shown once, at creation. */
export interface Channel {
    readonly id: string;
    readonly name: string;
    readonly status: string;
    readonly createdAt: string | undefined;
    readonly secret: string | undefined;
    /** What a send means while a turn runs (undefined: the node's default). */
    readonly turnPolicy: string | undefined;
    /** The policies a send may ask for instead. */
    readonly turnPolicyOverrides: string[];
    /** `"cancel"`: the last end-user connection leaving cancels the running turn. */
    readonly onDisconnect: string;
    readonly raw: JsonObject;
}

/** A token and its lifetime in seconds. */
export interface IssuedToken {
    readonly token: string;
    readonly expiresIn: number | undefined;
}

/** A new conversation and a conversation-scope token bound to it. */
export interface CreatedConversation {
    readonly conversationId: string;
    readonly userId: string;
    readonly token: string;
    readonly expiresIn: number | undefined;
}

/**
 * One page of a conversation's persistent frames (`seq` > the asked watermark). `watermark` is
 * the last returned seq (the asked one for an empty page); `hasMore` tells whether another page
 * follows.
 */
export interface ActivityPage {
    readonly activities: Message[];
    readonly watermark: number;
    readonly hasMore: boolean;
}

/** A posted frame's `id` and `seq`; `duplicate` for a repeated idempotency key. */
export interface PostedActivity {
    readonly id: string;
    readonly seq: number;
    readonly duplicate: boolean;
}

/** Whether a turn is stopping now, and which (`seq` undefined when none was running). */
export interface StopResult {
    readonly stopped: boolean;
    readonly seq: number | undefined;
}

/** A conversation as the tenant API lists it (`GET /api/v1/conversations`). */
export interface ConversationInfo {
    readonly id: string;
    readonly channelId: string | undefined;
    readonly userId: string | undefined;
    readonly status: string | undefined;
    readonly raw: JsonObject;
}

export interface ConversationList {
    readonly conversations: ConversationInfo[];
    /** Pass as `cursor` for the next page; undefined on the last one. */
    readonly nextCursor: string | undefined;
}

export interface ListConversationsOptions {
    status?: "open" | "closed";
    channelId?: string;
    userId?: string;
    updatedSince?: number;
    limit?: number;
    cursor?: string;
}

export interface TurnSettings {
    turnPolicy?: string;
    turnPolicyOverrides?: string[];
    onDisconnect?: string;
    /** Gives the channel the node's default policy back. */
    defaultTurnPolicy?: boolean;
}

export interface RestClientOptions {
    /** Bound of every call (default 10 s). */
    timeoutMs?: number;
    /** The fetch to use (default: the global one). */
    fetch?: typeof fetch;
}

type Credential = { bearer: string } | { apiKey: string } | undefined;

interface CallOptions {
    credential?: Credential;
    body?: unknown;
    query?: Record<string, string | number | undefined>;
    headers?: Record<string, string>;
}

function parseChannel(body: JsonObject): Channel {
    return {
        id: asString(body.id) ?? "",
        name: asString(body.name) ?? "",
        status: asString(body.status) ?? "",
        createdAt: asString(body.createdAt),
        secret: asString(body.secret),
        turnPolicy: asString(body.turnPolicy),
        turnPolicyOverrides: asStringArray(body.turnPolicyOverrides),
        onDisconnect: asString(body.onDisconnect) ?? "continue",
        raw: body,
    };
}

function parseIssuedToken(body: JsonObject): IssuedToken {
    return { token: asString(body.token) ?? "", expiresIn: asInt(body.expires_in) };
}

function parseConversationInfo(body: JsonObject): ConversationInfo {
    return {
        id: asString(body.id) ?? asString(body.conversationId) ?? "",
        channelId: asString(body.channelId),
        userId: asString(body.userId),
        status: asString(body.status),
        raw: body,
    };
}

/** `Retry-After` in ms (seconds or an HTTP date), when given. */
function retryAfterMs(header: string | null): number | undefined {
    if (header === null) {
        return undefined;
    }
    const seconds = Number(header);
    if (Number.isFinite(seconds)) {
        return Math.max(seconds * 1000, 0);
    }
    const date = Date.parse(header);
    return Number.isNaN(date) ? undefined : Math.max(date - Date.now(), 0);
}

/** A client of one node's REST API (`baseUrl` like `http://127.0.0.1:8080`). */
export class RestClient {
    readonly baseUrl: string;
    readonly #timeoutMs: number;
    readonly #fetch: typeof fetch;

    constructor(baseUrl: string, options: RestClientOptions = {}) {
        this.baseUrl = baseUrl.replace(/\/+$/, "");
        this.#timeoutMs = options.timeoutMs ?? 10_000;
        this.#fetch = options.fetch ?? ((input, init) => globalThis.fetch(input, init));
    }

    async #call(method: string, path: string, options: CallOptions = {}): Promise<Response> {
        const url = new URL(`${this.baseUrl}${path}`);
        for (const [key, value] of Object.entries(options.query ?? {})) {
            if (value !== undefined) {
                url.searchParams.set(key, String(value));
            }
        }
        const headers: Record<string, string> = { ...(options.headers ?? {}) };
        const credential = options.credential;
        if (credential !== undefined && "bearer" in credential) {
            headers.Authorization = `Bearer ${credential.bearer}`;
        } else if (credential !== undefined) {
            headers["x-api-key"] = credential.apiKey;
        }
        let body: string | undefined;
        if (options.body !== undefined) {
            headers["Content-Type"] = "application/json";
            body = JSON.stringify(options.body);
        }
        const response = await this.#fetch(url, {
            method,
            headers,
            body,
            signal: AbortSignal.timeout(this.#timeoutMs),
        });
        if (response.status >= 400) {
            throw await errorOf(response);
        }
        return response;
    }

    async #json(method: string, path: string, options: CallOptions = {}): Promise<JsonObject> {
        const response = await this.#call(method, path, options);
        return asObject(await response.json());
    }

    // --- admin ---------------------------------------------------------------------------

    /** `POST /api/v1/admin/tenants`: a tenant and its API key. */
    async createTenant(adminToken: string, name: string): Promise<Tenant> {
        const body = await this.#json("POST", "/api/v1/admin/tenants", {
            credential: { bearer: adminToken },
            body: { name },
        });
        return {
            id: asString(body.id) ?? "",
            name: asString(body.name) ?? "",
            apiKey: asString(body.apiKey) ?? "",
        };
    }

    /** `GET /api/v1/admin/cluster`: this node's view of the cluster. */
    cluster(adminToken: string): Promise<JsonObject> {
        return this.#json("GET", "/api/v1/admin/cluster", { credential: { bearer: adminToken } });
    }

    // --- channels (API key) --------------------------------------------------------------

    /** `POST /api/v1/channels`: a channel and its secret. */
    async createChannel(apiKey: string, name: string): Promise<Channel> {
        return parseChannel(
            await this.#json("POST", "/api/v1/channels", {
                credential: { apiKey },
                body: { name },
            }),
        );
    }

    /** `GET /api/v1/channels`: the tenant's channels (without secrets). */
    async listChannels(apiKey: string): Promise<Channel[]> {
        const body = await this.#json("GET", "/api/v1/channels", { credential: { apiKey } });
        return Array.isArray(body.channels) ? body.channels.filter(isObject).map(parseChannel) : [];
    }

    /** `PATCH /api/v1/channels/{id}` to `active` or `inactive` (which closes its sockets, 4403). */
    async setChannelStatus(
        apiKey: string,
        channelId: string,
        status: "active" | "inactive",
    ): Promise<Channel> {
        return parseChannel(
            await this.#json("PATCH", `/api/v1/channels/${encodeURIComponent(channelId)}`, {
                credential: { apiKey },
                body: { status },
            }),
        );
    }

    /** `PATCH /api/v1/channels/{id}`: the channel's turn settings (docs/protocol.md §3.10). */
    async setTurnSettings(
        apiKey: string,
        channelId: string,
        settings: TurnSettings,
    ): Promise<Channel> {
        const body: JsonObject = {};
        if (settings.defaultTurnPolicy === true) {
            body.turnPolicy = null;
        } else if (settings.turnPolicy !== undefined) {
            body.turnPolicy = settings.turnPolicy;
        }
        if (settings.turnPolicyOverrides !== undefined) {
            body.turnPolicyOverrides = [...settings.turnPolicyOverrides];
        }
        if (settings.onDisconnect !== undefined) {
            body.onDisconnect = settings.onDisconnect;
        }
        return parseChannel(
            await this.#json("PATCH", `/api/v1/channels/${encodeURIComponent(channelId)}`, {
                credential: { apiKey },
                body,
            }),
        );
    }

    // --- conversations (API key) ---------------------------------------------------------

    /** `GET /api/v1/conversations`: one page of the tenant's conversations. */
    async listConversations(
        apiKey: string,
        options: ListConversationsOptions = {},
    ): Promise<ConversationList> {
        const body = await this.#json("GET", "/api/v1/conversations", {
            credential: { apiKey },
            query: { ...options },
        });
        const conversations = Array.isArray(body.conversations)
            ? body.conversations.filter(isObject).map(parseConversationInfo)
            : [];
        return { conversations, nextCursor: asString(body.nextCursor) };
    }

    /** `GET /api/v1/conversations/{id}`: one of the tenant's conversations. */
    async getConversation(apiKey: string, conversationId: string): Promise<ConversationInfo> {
        return parseConversationInfo(
            await this.#json("GET", `/api/v1/conversations/${encodeURIComponent(conversationId)}`, {
                credential: { apiKey },
            }),
        );
    }

    // --- tokens --------------------------------------------------------------------------

    /**
     * `POST /api/v1/converger/tokens/generate` with the channel secret. `scope: "channel"` gives
     * an agent token (`userId` then sets the agent's `sender.id`); the default is an end user's
     * conversation-scope token, optionally bound to `conversationId`.
     */
    async generateToken(
        secret: string,
        options: {
            userId?: string;
            scope?: "conversation" | "channel";
            conversationId?: string;
        } = {},
    ): Promise<IssuedToken> {
        const body: JsonObject = {};
        if (options.userId !== undefined) {
            body.user = { id: options.userId };
        }
        if (options.scope !== undefined) {
            body.scope = options.scope;
        }
        if (options.conversationId !== undefined) {
            body.conversationId = options.conversationId;
        }
        return parseIssuedToken(
            await this.#json("POST", "/api/v1/converger/tokens/generate", {
                credential: { bearer: secret },
                body,
            }),
        );
    }

    /** `POST /api/v1/converger/tokens/refresh`: the same claims with a new expiry. */
    async refreshToken(token: string): Promise<IssuedToken> {
        return parseIssuedToken(
            await this.#json("POST", "/api/v1/converger/tokens/refresh", {
                credential: { bearer: token },
            }),
        );
    }

    // --- conversations (token) -----------------------------------------------------------

    /**
     * `POST /api/v1/converger/conversations`: a conversation and a token bound to it. The user is
     * the token's, else `userId`, else `anon-…`.
     */
    async createConversation(
        token: string,
        options: { userId?: string } = {},
    ): Promise<CreatedConversation> {
        const body: JsonObject = options.userId === undefined ? {} : { userId: options.userId };
        const created = await this.#json("POST", "/api/v1/converger/conversations", {
            credential: { bearer: token },
            body,
        });
        return {
            conversationId: asString(created.conversationId) ?? "",
            userId: asString(created.userId) ?? "",
            token: asString(created.token) ?? "",
            expiresIn: asInt(created.expires_in),
        };
    }

    /**
     * `GET …/conversations/{id}/activities`: one page of frames after `watermark` (the history a
     * UI shows). A channel-scope token gets the agent view, a conversation-scope one the user's.
     */
    async listActivities(
        token: string,
        conversationId: string,
        options: { watermark?: number; limit?: number; view?: "transcript" | "chat" } = {},
    ): Promise<ActivityPage> {
        const watermark = options.watermark ?? 0;
        const body = await this.#json(
            "GET",
            `/api/v1/converger/conversations/${encodeURIComponent(conversationId)}/activities`,
            {
                credential: { bearer: token },
                query: { watermark, limit: options.limit ?? 100, view: options.view },
            },
        );
        const raw = Array.isArray(body.activities) ? body.activities : [];
        const activities: Message[] = [];
        for (const item of raw) {
            const message = parseMessage(asObject(item));
            if (message !== undefined) {
                activities.push(message);
            }
        }
        return {
            activities,
            watermark: asInt(body.watermark) ?? watermark,
            hasMore: body.hasMore === true,
        };
    }

    /** Every frame after `watermark`, page by page. */
    async allActivities(
        token: string,
        conversationId: string,
        options: { watermark?: number } = {},
    ): Promise<Message[]> {
        const frames: Message[] = [];
        let watermark = options.watermark ?? 0;
        for (;;) {
            const page = await this.listActivities(token, conversationId, {
                watermark,
                limit: 1000,
            });
            frames.push(...page.activities);
            if (!page.hasMore || page.watermark <= watermark) {
                return frames;
            }
            watermark = page.watermark;
        }
    }

    /**
     * `POST …/conversations/{id}/activities`: stores a message frame. `idempotencyKey`
     * (`x-idempotency-key`) makes a repeat answer the original `{id, seq}` (`duplicate: true`).
     */
    async postActivity(
        token: string,
        conversationId: string,
        frame: FrameLike,
        options: { idempotencyKey?: string } = {},
    ): Promise<PostedActivity> {
        const response = await this.#call(
            "POST",
            `/api/v1/converger/conversations/${encodeURIComponent(conversationId)}/activities`,
            {
                credential: { bearer: token },
                body: frameOf(frame),
                headers:
                    options.idempotencyKey === undefined
                        ? {}
                        : { "x-idempotency-key": options.idempotencyKey },
            },
        );
        const body = asObject(await response.json());
        return {
            id: asString(body.id) ?? "",
            seq: asInt(body.seq) ?? 0,
            duplicate: response.status === 200,
        };
    }

    /**
     * `POST …/conversations/{id}/stop`: stops the running turn at `seq`, or the latest
     * unanswered one (docs/protocol.md §3.9). Idempotent.
     */
    async stopTurn(
        token: string,
        conversationId: string,
        options: { seq?: number } = {},
    ): Promise<StopResult> {
        const answer = await this.#json(
            "POST",
            `/api/v1/converger/conversations/${encodeURIComponent(conversationId)}/stop`,
            {
                credential: { bearer: token },
                body: options.seq === undefined ? {} : { seq: options.seq },
            },
        );
        return { stopped: answer.stopped === true, seq: asInt(answer.seq) };
    }

    /** `POST …/conversations/{id}/close` (idempotent): the status change. */
    closeConversation(token: string, conversationId: string, reason?: string): Promise<JsonObject> {
        return this.#json(
            "POST",
            `/api/v1/converger/conversations/${encodeURIComponent(conversationId)}/close`,
            {
                credential: { bearer: token },
                body: reason === undefined ? {} : { reason },
            },
        );
    }

    /** `POST …/conversations/{id}/reopen` (idempotent): the status change. */
    reopenConversation(
        token: string,
        conversationId: string,
        reason?: string,
    ): Promise<JsonObject> {
        return this.#json(
            "POST",
            `/api/v1/converger/conversations/${encodeURIComponent(conversationId)}/reopen`,
            {
                credential: { bearer: token },
                body: reason === undefined ? {} : { reason },
            },
        );
    }

    // --- health and helpers --------------------------------------------------------------

    /** `GET /health/ready`: whether the node serves (false while draining). */
    async ready(): Promise<boolean> {
        try {
            await this.#call("GET", "/health/ready");
            return true;
        } catch (error) {
            if (error instanceof RestError) {
                return false;
            }
            throw error;
        }
    }

    /** For tests and tools: a new conversation of `userId` and its bound token. */
    async mintConversation(secret: string, userId: string): Promise<CreatedConversation> {
        const issued = await this.generateToken(secret, { userId });
        return this.createConversation(issued.token);
    }

    /** For tests and tools: a channel-scope (agent) token from the channel secret. */
    async mintAgentToken(secret: string, options: { userId?: string } = {}): Promise<string> {
        return (await this.generateToken(secret, { userId: options.userId, scope: "channel" }))
            .token;
    }
}

/** A new conversation of `userId` and its bound token, minted with the channel secret. */
export function mintConversation(
    baseUrl: string,
    secret: string,
    userId: string,
): Promise<CreatedConversation> {
    return new RestClient(baseUrl).mintConversation(secret, userId);
}

/** A channel-scope (agent) token minted with the channel secret. */
export function mintAgentToken(
    baseUrl: string,
    secret: string,
    options: { userId?: string } = {},
): Promise<string> {
    return new RestClient(baseUrl).mintAgentToken(secret, options);
}

async function errorOf(response: Response): Promise<RestError> {
    const status = response.status;
    const text = await response.text().catch(() => "");
    let body: unknown = text;
    try {
        body = JSON.parse(text);
    } catch {
        // not JSON: keep the text
    }
    const error = asObject(asObject(body).error);
    const code = asString(error.code) ?? `http_${status}`;
    const message = asString(error.message) ?? response.statusText;
    const ErrorClass = restErrorClass(status);
    return new ErrorClass(
        status,
        code,
        message,
        retryAfterMs(response.headers.get("Retry-After")),
        body,
    );
}
