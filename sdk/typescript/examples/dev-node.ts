// What the examples share: waiting for the node, which may not be up yet when they start, and
// serving turns until SIGTERM or Ctrl-C (serveTurns()).
//
// A first `cargo run -p converger-cli -- serve` builds the gateway for minutes before the node
// listens. Each example calls waitForNode() with its CONVERGER_URL before it connects: that polls
// the node's `GET /health/ready` every second until it answers 200, says once on stderr what it
// waits for, and gives up with a message after 10 minutes. Without CONVERGER_AGENT_TOKEN,
// streaming-agent.ts then reads the admin token the node generated in `.converger/admin_token`
// of the directory it was started in (the repository root; found from anywhere inside the
// repository) with readAdminToken().

import { existsSync } from "node:fs";
import { readFile } from "node:fs/promises";
import { dirname, join } from "node:path";
import type { Agent, Turn } from "../src/index.js";

/** How long to wait for the node: the first build of the gateway takes several minutes. */
const WAIT_MS = 600_000;
/** The pause between two readiness checks. */
const POLL_MS = 1000;
/** Bound of one readiness check. */
const CHECK_TIMEOUT_MS = 5000;
const START_HINT = "start it with `cargo run -p converger-cli -- serve` in the repository root";

/** The node's HTTP origin for `url`: `ws://host:port/…` gives `http://host:port`. */
export function httpOrigin(url: string): string {
    const parsed = new URL(url);
    const scheme =
        parsed.protocol === "ws:"
            ? "http:"
            : parsed.protocol === "wss:"
              ? "https:"
              : parsed.protocol;
    return `${scheme}//${parsed.host}`;
}

/** Why the node is not ready yet, or undefined once `GET /health/ready` answers 200. */
async function notReady(origin: string): Promise<string | undefined> {
    try {
        const response = await fetch(`${origin}/health/ready`, {
            signal: AbortSignal.timeout(CHECK_TIMEOUT_MS),
        });
        await response.body?.cancel();
        return response.ok ? undefined : `GET /health/ready answered ${response.status}`;
    } catch (error) {
        return error instanceof Error ? error.message : String(error);
    }
}

/** Resolves once the node at `url` is ready; exits the program after `timeoutMs`. */
export async function waitForNode(url: string, timeoutMs = WAIT_MS): Promise<void> {
    const origin = httpOrigin(url);
    const deadline = Date.now() + timeoutMs;
    let waiting = false;
    for (
        let reason = await notReady(origin);
        reason !== undefined;
        reason = await notReady(origin)
    ) {
        if (Date.now() >= deadline) {
            console.error(
                `the node at ${origin} is not ready after ${timeoutMs / 1000} s (${reason}); ${START_HINT}`,
            );
            process.exit(1);
        }
        if (!waiting) {
            console.error(`waiting for the node at ${origin} (${START_HINT})…`);
            waiting = true;
        }
        await new Promise((done) => setTimeout(done, POLL_MS));
    }
    if (waiting) {
        console.error(`the node at ${origin} answers`);
    }
}

/**
 * Where the development node wrote its admin token: `.converger/admin_token` in the working
 * directory or the nearest directory above it that has one (the repository root, where the node
 * was started, from anywhere inside the repository).
 */
function adminTokenFile(): string | undefined {
    for (let directory = process.cwd(); ; directory = dirname(directory)) {
        const candidate = join(directory, ".converger", "admin_token");
        if (existsSync(candidate)) {
            return candidate;
        }
        if (dirname(directory) === directory) {
            return undefined;
        }
    }
}

/** The admin token the development node generated; exits the program when there is none. */
export async function readAdminToken(): Promise<string> {
    const path = adminTokenFile();
    if (path === undefined) {
        console.error(
            "no .converger/admin_token in this directory or above it: run this inside the " +
                "repository whose root the node was started in, or set CONVERGER_AGENT_TOKEN to a " +
                `channel-scope token instead, or ${START_HINT}`,
        );
        process.exit(1);
    }
    return (await readFile(path, "utf8")).trim();
}

/**
 * Connects `agent`, prints `ready <connectionId> <since>` (the line the tests wait for), and
 * answers turns with `handle`, 8 at a time, until SIGTERM or Ctrl-C: then agent.stop() lets
 * run() drain, and this resolves.
 */
export async function serveTurns(
    agent: Agent,
    handle: (turn: Turn) => Promise<void>,
): Promise<void> {
    const welcome = await agent.connect();
    console.log(`ready ${welcome.connectionId} ${welcome.since}`);
    for (const signal of ["SIGTERM", "SIGINT"] as const) {
        process.once(signal, () => agent.stop());
    }
    await agent.run(handle, { concurrency: 8 });
}
