// Test support: a real `converger serve` process over a fresh database, a tenant with a channel,
// a raw agent socket, a TCP proxy that injects network faults, and waits for observable
// conditions (never for a guessed amount of time). Mirrors sdk/python/tests/support.py.

import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { createInterface } from "node:readline";
import { after, before } from "node:test";
import { fileURLToPath } from "node:url";
import { WebSocket } from "ws";
import { Backoff } from "../src/backoff.js";
import { SUBPROTOCOL, wsUrl } from "../src/connection.js";
import { Conversation } from "../src/conversation.js";
import { type Message, parseMessage } from "../src/frames.js";
import { asInt, asObject, asString, type JsonObject, parseObject } from "../src/json.js";
import { RestClient } from "../src/rest.js";

/** The package directory, found from this file whether it runs from test/ or build/test/. */
function packageDir(): string {
    let directory = path.dirname(fileURLToPath(import.meta.url));
    while (!existsSync(path.join(directory, "package.json"))) {
        const parent = path.dirname(directory);
        if (parent === directory) {
            throw new Error("package.json not found above the tests");
        }
        directory = parent;
    }
    return directory;
}

export const PACKAGE_DIR = packageDir();
export const REPO_ROOT = path.resolve(PACKAGE_DIR, "../..");
export const DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/postgres";
/** The longest any single observable event may take in these tests. */
export const WAIT_MS = 15_000;
const NODE_START_TIMEOUT_MS = 60_000;
const SETTLE_MS = 300;
/** Every test against a node ends within this, whatever hangs (each wait is bounded). */
export const LIMIT = { timeout: 30_000 };
/** Faults are injected on purpose: come back quickly. */
export const FAST = new Backoff({ initialMs: 50, maximumMs: 300 });

/** `[secretKey, adminToken]` of config/test.toml. */
export function testSecrets(): [string, string] {
    try {
        const text = readFileSync(path.join(REPO_ROOT, "config/test.toml"), "utf8");
        const secret = /^secret_key\s*=\s*"([^"]+)"/m.exec(text)?.[1];
        const admin = /^admin_token\s*=\s*"([^"]+)"/m.exec(text)?.[1];
        if (secret !== undefined && admin !== undefined) {
            return [secret, admin];
        }
    } catch {
        // fall through to the defaults of the file as shipped
    }
    return ["test-secret-key-0123456789abcdef0123456789", "test-admin-token-0123456789"];
}

/** CONVERGER_BIN, else the debug build in CARGO_TARGET_DIR, else in <repo root>/target. */
export function convergerBin(): string {
    const configured = process.env.CONVERGER_BIN;
    if (configured) {
        return configured;
    }
    const target = process.env.CARGO_TARGET_DIR || path.join(REPO_ROOT, "target");
    return path.join(target, "debug", "converger");
}

// --- Postgres -------------------------------------------------------------------------------
//
// psql rather than a driver: it is there wherever the PostgreSQL binaries are (which the node's
// embedded fallback needs anyway), speaks the same URLs as the node, and adds no dependency.

function psql(url: string, sql: string, timeoutMs = 30_000): { ok: boolean; output: string } {
    const done = spawnSync(
        "psql",
        [url, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql],
        {
            encoding: "utf8",
            timeout: timeoutMs,
            env: { ...process.env, PGCONNECT_TIMEOUT: "5" },
        },
    );
    return { ok: done.status === 0, output: `${done.stdout ?? ""}${done.stderr ?? ""}` };
}

let serverChecked: string | null | undefined;

/** The maintenance URL of the test Postgres, or null when nothing answers there. */
export function postgresServer(): string | null {
    if (serverChecked !== undefined) {
        return serverChecked;
    }
    const url = process.env.CONVERGER_TEST_DATABASE_URL || DEFAULT_DATABASE_URL;
    const answered = psql(url, "SELECT 1", 15_000).ok;
    if (!answered) {
        console.error(
            `nothing answers at ${url} (or psql is missing); nodes start their embedded Postgres`,
        );
    }
    serverChecked = answered ? url : null;
    return serverChecked;
}

function withDatabase(url: string, name: string): string {
    const parsed = new URL(url);
    parsed.pathname = `/${name}`;
    return parsed.toString();
}

// --- The node process -----------------------------------------------------------------------

/** One `converger serve` process. */
export class Node {
    constructor(
        readonly process: ChildProcess,
        readonly baseUrl: string,
        readonly adminToken: string,
        readonly databaseUrl: string,
        readonly stateDir: string,
        readonly databaseName: string | undefined,
        readonly server: string | null,
        /** The node's log lines (JSON), the latest 2000. */
        readonly logs: string[] = [],
        /** Whether it runs over another node's embedded Postgres (whose state directory it uses). */
        readonly guest = false,
    ) {}

    get port(): number {
        return Number(new URL(this.baseUrl).port);
    }

    get wsUrl(): string {
        return wsUrl(this.baseUrl);
    }

    get embedded(): boolean {
        return this.databaseUrl === "";
    }

    /**
     * Ends the process (SIGKILL over a shared Postgres; SIGTERM with the embedded one, so it
     * stops its private Postgres), then drops the database and the state directory.
     */
    async stop(): Promise<void> {
        const exited = new Promise<void>((resolve) => {
            if (this.process.exitCode !== null || this.process.signalCode !== null) {
                resolve();
                return;
            }
            this.process.once("exit", () => resolve());
        });
        this.process.kill(this.embedded ? "SIGTERM" : "SIGKILL");
        const killer = setTimeout(() => this.process.kill("SIGKILL"), 20_000);
        await exited;
        clearTimeout(killer);
        if (this.server !== null && this.databaseName !== undefined) {
            const dropped = psql(
                this.server,
                `DROP DATABASE IF EXISTS ${this.databaseName} WITH (FORCE)`,
            );
            if (!dropped.ok) {
                console.error(`could not drop ${this.databaseName}: ${dropped.output}`);
            }
        }
        // A guest's state directory is its host's, which the host removes.
        if (!this.guest) {
            rmSync(this.stateDir, { recursive: true, force: true });
        }
    }

    /** The last log lines, for a failure report. */
    tail(lines = 40): string {
        return this.logs.slice(-lines).join("\n");
    }
}

/** How {@link startNode} picks the node's database. */
export interface StartOptions {
    /**
     * A running node whose database the new node uses too: its database on the shared Postgres,
     * or, when it runs its own embedded Postgres, that Postgres (through its state directory).
     */
    readonly shareDatabaseOf?: Node;
}

/**
 * Starts a node over a fresh database (or its embedded Postgres when no server answers) and waits
 * until its logs show it listening (HTTP, gossip and the event bus). `env` adds configuration.
 */
export async function startNode(
    env: Record<string, string> = {},
    options: StartOptions = {},
): Promise<Node> {
    const [secretKey, adminToken] = testSecrets();
    const binary = convergerBin();
    if (!existsSync(binary)) {
        throw new Error(
            `${binary} is missing: build it (cargo build -p converger-cli) or set CONVERGER_BIN`,
        );
    }
    const host = options.shareDatabaseOf;
    const guest = host?.embedded === true;
    const server = host === undefined ? postgresServer() : null;
    let databaseName: string | undefined;
    let databaseUrl = host?.databaseUrl ?? "";
    if (server !== null) {
        databaseName = `converger_sdk_${randomBytes(12).toString("hex")}`;
        const created = psql(server, `CREATE DATABASE ${databaseName}`);
        if (!created.ok) {
            throw new Error(`cannot create ${databaseName}: ${created.output}`);
        }
        databaseUrl = withDatabase(server, databaseName);
    }
    const stateDir = guest ? host.stateDir : mkdtempSync(path.join(tmpdir(), "converger-sdk-ts-"));
    const child = spawn(binary, ["serve"], {
        cwd: stateDir,
        stdio: ["ignore", "ignore", "pipe"],
        env: {
            ...process.env,
            CONVERGER_DATABASE_URL: databaseUrl,
            CONVERGER_HTTP_ADDR: "127.0.0.1:0",
            CONVERGER_GOSSIP_ADDR: "127.0.0.1:0",
            CONVERGER_SECRET_KEY: secretKey,
            CONVERGER_ADMIN_TOKEN: adminToken,
            CONVERGER_STATE_DIR: stateDir,
            CONVERGER_GROUP_SETTLE_MS: String(SETTLE_MS),
            CONVERGER_DRAIN__BATCH_INTERVAL_MS: "10",
            CONVERGER_DRAIN__RETRY_AFTER_MS: "50",
            CONVERGER_DRAIN__TIMEOUT_MS: "2000",
            CONVERGER_LOG_FORMAT: "json",
            RUST_LOG: process.env.NODE_LOG_FILTER ?? "info,sqlx=warn,chitchat=warn",
            ...env,
        },
    });
    const logs: string[] = [];
    const found = new Map<string, string>();
    const started = new Promise<void>((resolve, reject) => {
        const timer = setTimeout(
            () => reject(new Error("the node did not start in time")),
            NODE_START_TIMEOUT_MS,
        );
        child.once("exit", (code) => {
            clearTimeout(timer);
            reject(new Error(`the node exited with ${code} before listening`));
        });
        // Every line is read until the process ends, so the node never blocks on a full pipe.
        const lines = createInterface({ input: child.stderr ?? process.stdin });
        lines.on("line", (line) => {
            logs.push(line);
            if (logs.length > 2000) {
                logs.shift();
            }
            const fields = asObject(parseObject(line)?.fields);
            const message = asString(fields.message);
            if (message === "converger listening") {
                found.set("http", String(fields.addr));
            } else if (message === "gossip started") {
                found.set("gossip", String(fields.gossip_addr));
            } else if (message === "event bus listening") {
                found.set("bus", "yes");
            }
            if (found.size === 3) {
                clearTimeout(timer);
                resolve();
            }
        });
    });
    try {
        await started;
    } catch (error) {
        await new Node(
            child,
            "",
            adminToken,
            databaseUrl,
            stateDir,
            databaseName,
            server,
            logs,
            guest,
        ).stop();
        throw new Error(`${String(error)}\n${logs.slice(-30).join("\n")}`);
    }
    const address = found.get("http");
    return new Node(
        child,
        `http://${address}`,
        adminToken,
        databaseUrl,
        stateDir,
        databaseName,
        server,
        logs,
        guest,
    );
}

/**
 * Registers a `before` that starts a node with `env` (see {@link startNode}) and an `after` that
 * stops it, in the enclosing suite (or file); returns the getter of that node.
 */
export function withNode(env: Record<string, string> = {}): () => Node {
    let node: Node | undefined;
    before(async () => {
        node = await startNode(env);
    });
    after(async () => {
        await node?.stop();
    });
    return () => {
        if (node === undefined) {
            throw new Error("the node is not started (withNode's before did not run)");
        }
        return node;
    };
}

// --- A tenant and a channel -----------------------------------------------------------------

/** A node with a tenant and one channel, and a REST client for it. */
export class Tenant {
    constructor(
        readonly node: Node,
        readonly rest: RestClient,
        readonly apiKey: string,
        readonly channelId: string,
        readonly channelSecret: string,
    ) {}

    get url(): string {
        return this.node.baseUrl;
    }

    agentToken(userId?: string): Promise<string> {
        return this.rest.mintAgentToken(this.channelSecret, { userId });
    }

    /** A new conversation of `userId`: its id and a token bound to it. */
    async conversation(userId = "alice"): Promise<{ conversationId: string; token: string }> {
        const created = await this.rest.mintConversation(this.channelSecret, userId);
        return { conversationId: created.conversationId, token: created.token };
    }

    /**
     * An end user's connected Conversation on a new conversation of `userId`, through `url`
     * (the node's, unless a proxy's is given).
     */
    async endUser(
        options: { url?: string; userId?: string } = {},
    ): Promise<{ conversationId: string; token: string; user: Conversation }> {
        const { conversationId, token } = await this.conversation(options.userId);
        const user = new Conversation(options.url ?? this.url, token, { backoff: FAST });
        await user.connect();
        return { conversationId, token, user };
    }

    /** Every stored frame of the conversation (agent view, over REST). */
    async frames(conversationId: string): Promise<Message[]> {
        return this.rest.allActivities(await this.agentToken(), conversationId);
    }
}

/** A fresh tenant with a channel named "web" on `node`. */
export async function setupTenant(node: Node): Promise<Tenant> {
    const rest = new RestClient(node.baseUrl);
    const tenant = await rest.createTenant(
        node.adminToken,
        `acme-${randomBytes(4).toString("hex")}`,
    );
    const channel = await rest.createChannel(tenant.apiKey, "web");
    if (channel.secret === undefined) {
        throw new Error("the new channel came without its secret");
    }
    return new Tenant(node, rest, tenant.apiKey, channel.id, channel.secret);
}

// --- Waiting for things ---------------------------------------------------------------------

/**
 * Resolves once `since` (a member's `welcome.since`, ms since the epoch) has passed on this
 * machine's clock. A member owns nothing committed before its `since` (unless it is alone in
 * its group); the node signals nothing when it passes, so this is a wait for a server-given
 * instant, not a guessed delay.
 */
export async function untilSince(since: number | undefined): Promise<void> {
    if (since !== undefined && since > Date.now()) {
        await new Promise((resolve) => setTimeout(resolve, since - Date.now() + 20));
    }
}

/** Polls an observable condition (sync or async) until it holds. */
export async function eventually(
    condition: () => unknown,
    options: { timeoutMs?: number; what?: string; everyMs?: number } = {},
): Promise<void> {
    const deadline = Date.now() + (options.timeoutMs ?? WAIT_MS);
    for (;;) {
        if (await condition()) {
            return;
        }
        if (Date.now() > deadline) {
            throw new Error(`timed out waiting for: ${options.what ?? condition.toString()}`);
        }
        await new Promise((resolve) => setTimeout(resolve, options.everyMs ?? 20));
    }
}

/** The next item of an async iterator matching `predicate` (others are skipped). */
export async function firstOf<T>(
    iterable: AsyncIterable<T>,
    predicate: (item: T) => boolean,
    timeoutMs = WAIT_MS,
): Promise<T> {
    const iterator = iterable[Symbol.asyncIterator]();
    const deadline = Date.now() + timeoutMs;
    for (;;) {
        const remaining = deadline - Date.now();
        let timer: ReturnType<typeof setTimeout> | undefined;
        const timeout = new Promise<"timeout">((resolve) => {
            timer = setTimeout(() => resolve("timeout"), Math.max(remaining, 0));
        });
        const result = await Promise.race([iterator.next(), timeout]);
        clearTimeout(timer);
        if (result === "timeout") {
            throw new Error(`no matching item within ${timeoutMs} ms`);
        }
        if (result.done) {
            throw new Error("the iterator ended");
        }
        if (predicate(result.value)) {
            return result.value;
        }
    }
}

/** Whether a persistent frame is an agent's (group member's) answer. */
export const fromBot = (message: Message): boolean => message.from === "bot";

/**
 * The turn a delivered user frame is (its `meta.turn`): an edit is a frame of its own, with
 * its own seq, that revises an earlier turn.
 */
export function turnOf(frame: Message): { seq: number; revision: number } {
    const turn = asObject(asObject(frame.raw.meta).turn);
    return { seq: asInt(turn.seq) ?? frame.seq, revision: asInt(turn.revision) ?? 0 };
}

// --- A raw agent socket ---------------------------------------------------------------------

/**
 * A channel-scope WebSocket speaking the wire protocol directly (for tests that must control
 * every frame, or that run without the Agent class). Frames are kept in arrival order.
 */
export class RawAgent {
    readonly frames: JsonObject[] = [];
    #read = 0;

    private constructor(
        readonly socket: WebSocket,
        readonly welcome: JsonObject,
    ) {}

    /** Connects with `hello` (`group` "bot" unless given) and waits until it is eligible. */
    static async connect(url: string, token: string, hello: JsonObject = {}): Promise<RawAgent> {
        const socket = new WebSocket(wsUrl(url), [SUBPROTOCOL]);
        const early: JsonObject[] = [];
        const welcome = await new Promise<JsonObject>((resolve, reject) => {
            const timer = setTimeout(() => reject(new Error("no agent welcome in time")), WAIT_MS);
            socket.on("open", () => {
                socket.send(
                    JSON.stringify({
                        type: "hello",
                        protocol: "converger/1",
                        token,
                        group: "bot",
                        ...hello,
                    }),
                );
            });
            socket.on("message", (data) => {
                const frame = parseObject(data.toString());
                if (frame === undefined) {
                    return;
                }
                if (frame.type === "welcome") {
                    clearTimeout(timer);
                    resolve(asObject(frame.data));
                    return;
                }
                early.push(frame);
            });
            socket.on("close", (code, reason) => {
                clearTimeout(timer);
                reject(new Error(`agent socket closed: ${code} ${reason.toString()}`));
            });
            socket.on("error", (error) => reject(error));
        });
        const agent = new RawAgent(socket, welcome);
        agent.frames.push(...early);
        socket.removeAllListeners("message");
        socket.removeAllListeners("close");
        socket.on("message", (data) => {
            const frame = parseObject(data.toString());
            if (frame !== undefined) {
                agent.frames.push(frame);
            }
        });
        await untilSince(asInt(welcome.since));
        return agent;
    }

    /** The next unread frame matching `predicate` (frames before it are marked read). */
    async next(
        predicate: (frame: JsonObject) => boolean,
        timeoutMs = WAIT_MS,
    ): Promise<JsonObject> {
        let found: JsonObject | undefined;
        await eventually(
            () => {
                while (this.#read < this.frames.length) {
                    const frame = this.frames[this.#read];
                    this.#read += 1;
                    if (frame !== undefined && predicate(frame)) {
                        found = frame;
                        return true;
                    }
                }
                return false;
            },
            { timeoutMs, what: "an agent frame" },
        );
        if (found === undefined) {
            throw new Error("unreachable: eventually returned without a frame");
        }
        return found;
    }

    /** The next enveloped persistent user frame (a turn) of `conversationId`. */
    async nextTurn(
        conversationId?: string,
    ): Promise<{ conversationId: string; message: Message; frame: JsonObject }> {
        const envelope = await this.next((frame) => {
            const inner = asObject(frame.frame);
            return (
                (conversationId === undefined || frame.conversationId === conversationId) &&
                asInt(inner.seq) !== undefined &&
                inner.from === "user"
            );
        });
        const frame = asObject(envelope.frame);
        const message = parseMessage(frame);
        if (message === undefined) {
            throw new Error(`not a persistent frame: ${JSON.stringify(frame)}`);
        }
        return { conversationId: String(envelope.conversationId), message, frame };
    }

    /** Writes an envelope `{conversationId, frame}`. */
    sendEnveloped(conversationId: string, frame: JsonObject): void {
        this.socket.send(JSON.stringify({ conversationId, frame }));
    }

    /** Answers a turn with one text frame (a `turnResult`); the ack comes as a frame. */
    reply(conversationId: string, turn: Message, text: string, extra: JsonObject = {}): string {
        const clientId = `r-${randomBytes(8).toString("hex")}`;
        this.sendEnveloped(conversationId, {
            type: "turnResult",
            clientId,
            turn: turnOf(turn),
            frames: [{ type: "text", data: { text }, ...extra }],
        });
        return clientId;
    }

    async close(): Promise<void> {
        if (this.socket.readyState === WebSocket.CLOSED) {
            return;
        }
        const closed = new Promise<void>((resolve) => this.socket.once("close", () => resolve()));
        this.socket.close(1000);
        const timer = setTimeout(() => this.socket.terminate(), 2000);
        await closed;
        clearTimeout(timer);
    }
}

// --- A TCP proxy that injects network faults ------------------------------------------------

/**
 * Forwards 127.0.0.1:<port> to a node and breaks the connections on demand: `pause()` stops
 * forwarding (both directions, or only `"downstream"`, node → client: a lost ack), bytes then
 * wait in the proxy; `resume()` delivers them and goes on; `cut()` resets every open
 * connection (what waits is lost); `accepting = false` refuses new connections; `retarget()`
 * sends new connections to another node.
 */
export class Proxy {
    accepting = true;
    accepted = 0;
    #server: net.Server | undefined;
    #targetPort = 0;
    #paused: "both" | "downstream" | undefined;
    readonly #pairs = new Set<{ client: net.Socket; upstream: net.Socket }>();

    async start(targetPort: number): Promise<this> {
        this.#targetPort = targetPort;
        this.#server = net.createServer((client) => this.#serve(client, this.#targetPort));
        const server = this.#server;
        await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
        return this;
    }

    get port(): number {
        const address = this.#server?.address();
        if (address === null || address === undefined || typeof address === "string") {
            throw new Error("the proxy is not listening");
        }
        return address.port;
    }

    get url(): string {
        return `http://127.0.0.1:${this.port}`;
    }

    #serve(client: net.Socket, targetPort: number): void {
        if (!this.accepting) {
            client.resetAndDestroy();
            return;
        }
        const upstream = net.connect(targetPort, "127.0.0.1");
        const pair = { client, upstream };
        this.#pairs.add(pair);
        this.accepted += 1;
        client.pipe(upstream);
        upstream.pipe(client);
        // After the pipes, which would otherwise resume what the pause stopped.
        if (this.#paused !== undefined) {
            this.#pausePair(pair, this.#paused);
        }
        const end = (): void => {
            this.#pairs.delete(pair);
            client.destroy();
            upstream.destroy();
        };
        client.on("error", end).on("close", end);
        upstream.on("error", end).on("close", end);
    }

    /** New connections go to `targetPort` from now on (open ones stay where they are). */
    retarget(targetPort: number): void {
        this.#targetPort = targetPort;
    }

    /** Stops forwarding: what is written waits here until `resume()` (or is lost by `cut()`). */
    pause(direction: "both" | "downstream" = "both"): void {
        this.#paused = direction;
        for (const pair of this.#pairs) {
            this.#pausePair(pair, direction);
        }
    }

    #pausePair(
        pair: { client: net.Socket; upstream: net.Socket },
        direction: "both" | "downstream",
    ): void {
        // Unpiping (rather than pausing) keeps the pipe from resuming the source on 'drain'.
        pair.upstream.unpipe(pair.client);
        pair.upstream.pause();
        if (direction === "both") {
            pair.client.unpipe(pair.upstream);
            pair.client.pause();
        }
    }

    resume(): void {
        const direction = this.#paused;
        this.#paused = undefined;
        if (direction === undefined) {
            return;
        }
        for (const { client, upstream } of this.#pairs) {
            upstream.pipe(client);
            if (direction === "both") {
                client.pipe(upstream);
            }
        }
    }

    /** Resets every open connection, both sides (a dead network path). */
    cut(): void {
        for (const { client, upstream } of [...this.#pairs]) {
            client.resetAndDestroy();
            upstream.resetAndDestroy();
        }
        this.#pairs.clear();
    }

    async close(): Promise<void> {
        this.accepting = false;
        this.cut();
        const server = this.#server;
        if (server !== undefined) {
            await new Promise<void>((resolve) => server.close(() => resolve()));
        }
    }
}
