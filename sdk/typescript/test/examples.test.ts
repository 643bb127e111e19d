// The examples, compiled as `npm run build:examples` compiles them and run as their headers say
// (processes with their environment variables) against a real node, driven by an end user.
// Mirrors sdk/python/tests/test_examples.py.

import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import path from "node:path";
import { createInterface } from "node:readline";
import { describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import type { StreamUpdate } from "../src/assembly.js";
import type { Conversation } from "../src/conversation.js";
import type { Message } from "../src/frames.js";
import {
    eventually,
    firstOf,
    fromBot,
    LIMIT,
    PACKAGE_DIR,
    setupTenant,
    type Tenant,
    untilSince,
    WAIT_MS,
    withNode,
} from "./support.js";

const EXAMPLES_DIR = path.join(PACKAGE_DIR, "examples");
/** The compiled examples, beside the compiled tests (build/examples; tsconfig.test.json). */
const COMPILED_DIR = path.join(path.dirname(fileURLToPath(import.meta.url)), "..", "examples");
const EXAMPLES = ["echo-agent", "streaming-agent"];

/** An example running as a child process, its stdout read line by line. */
class Script {
    readonly lines: string[] = [];
    readonly #errors: string[] = [];
    readonly #child: ChildProcess;
    readonly #exited: Promise<number | null>;

    constructor(name: string, env: Record<string, string>) {
        this.#child = spawn(process.execPath, [path.join(COMPILED_DIR, `${name}.js`)], {
            env: { ...process.env, ...env },
            stdio: ["ignore", "pipe", "pipe"],
        });
        this.#exited = new Promise((resolve) => this.#child.once("exit", (code) => resolve(code)));
        if (this.#child.stdout !== null) {
            createInterface({ input: this.#child.stdout }).on("line", (line) =>
                this.lines.push(line),
            );
        }
        if (this.#child.stderr !== null) {
            createInterface({ input: this.#child.stderr }).on("line", (line) =>
                this.#errors.push(line),
            );
        }
    }

    /** The first stdout line starting with `prefix`, once printed. */
    async line(prefix: string): Promise<string> {
        await eventually(() => this.lines.some((line) => line.startsWith(prefix)), {
            what: `a line "${prefix}…" (stderr: ${this.#errors.slice(-5).join(" | ")})`,
        });
        return this.lines.find((line) => line.startsWith(prefix)) ?? "";
    }

    get errorText(): string {
        return this.#errors.join("\n");
    }

    /** SIGTERM, then the exit code (SIGKILL when it does not exit within WAIT_MS). */
    async terminate(): Promise<number | null> {
        this.#child.kill("SIGTERM");
        const killer = setTimeout(() => this.#child.kill("SIGKILL"), WAIT_MS);
        const code = await this.#exited;
        clearTimeout(killer);
        return code;
    }

    kill(): void {
        this.#child.kill("SIGKILL");
    }
}

const mainNode = withNode();

/** Starts an example as a member of `group` and waits until its `since` has passed. */
async function startExample(
    tenant: Tenant,
    name: string,
    group: string,
    extra: Record<string, string> = {},
): Promise<Script> {
    const script = new Script(name, {
        CONVERGER_URL: tenant.url,
        CONVERGER_AGENT_TOKEN: await tenant.agentToken(),
        CONVERGER_AGENT_GROUP: group,
        ...extra,
    });
    try {
        const ready = await script.line("ready ");
        await untilSince(Number(ready.split(" ")[2]));
    } catch (error) {
        script.kill();
        throw error;
    }
    return script;
}

async function stopExample(script: Script): Promise<void> {
    const code = await script.terminate();
    assert.equal(code, 0, script.errorText);
}

/** The updates of the next streamed answer, up to its end, and its stored frame. */
async function streamedAnswer(
    user: Conversation,
): Promise<{ updates: StreamUpdate[]; stored: Message }> {
    const iterator = user.streamUpdates();
    const updates = [await firstOf(iterator, () => true)];
    while (updates.at(-1)?.end === undefined) {
        updates.push(await firstOf(iterator, () => true));
    }
    const stored = await firstOf(user.messages(), fromBot);
    return { updates, stored };
}

describe("examples", () => {
    test("the echo agent answers with an echo and counts turns in the runtime", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        const script = await startExample(tenant, "echo-agent", "echo");
        const { user } = await tenant.endUser();
        try {
            const events = user.events();
            await user.sendText("hello");
            const typing = await firstOf(events, (event) => event.kind === "typing");
            assert.equal(typing.kind === "typing" && typing.isTyping, true);
            const first = await firstOf(user.messages(), fromBot);
            assert.equal(first.text, "echo 1: hello");
            await user.sendText("again");
            const second = await firstOf(user.messages(), fromBot);
            assert.equal(second.text, "echo 2: again"); // the count lives in the runtime state
        } finally {
            await user.close();
            await stopExample(script);
        }
    });

    test("the echo agent streams its echo word by word when asked", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        const script = await startExample(tenant, "echo-agent", "echo", {
            CONVERGER_ECHO_STREAM: "1",
        });
        const { user } = await tenant.endUser();
        try {
            await user.sendText("hello there");
            const { updates, stored } = await streamedAnswer(user);
            assert.deepEqual(
                updates.flatMap((update) =>
                    update.chunk === undefined ? [] : [update.chunk.text],
                ),
                ["echo ", "1: ", "hello ", "there"],
            );
            assert.equal(updates.at(-1)?.end?.committed, true);
            assert.deepEqual(
                [stored.id, stored.text],
                [updates.at(-1)?.streamId, "echo 1: hello there"],
            );
        } finally {
            await user.close();
            await stopExample(script);
        }
    });

    test(
        "the streaming agent streams a fake model's words, then commits the whole answer",
        LIMIT,
        async () => {
            const tenant = await setupTenant(mainNode());
            const script = await startExample(tenant, "streaming-agent", "llm", {
                CONVERGER_WORD_DELAY_MS: "10",
            });
            const { user } = await tenant.endUser();
            try {
                await user.sendText("what is streaming?");
                const { updates, stored } = await streamedAnswer(user);
                const chunks = updates.flatMap((update) =>
                    update.chunk === undefined ? [] : [update.chunk.text ?? ""],
                );
                assert.ok(chunks.length > 10, `${chunks.length} chunks`);
                assert.equal(chunks[0], "You ");
                assert.equal(stored.text, chunks.join(""));
                assert.match(
                    stored.text ?? "",
                    /^You said "what is streaming\?"\. .* exactly what you saw\.$/,
                );
                assert.equal(stored.id, updates.at(-1)?.streamId);
                assert.equal(updates.at(-1)?.end?.committed, true);
            } finally {
                await user.close();
                await stopExample(script);
            }
        },
    );

    test("every example documents its environment", LIMIT, () => {
        for (const name of EXAMPLES) {
            const text = readFileSync(path.join(EXAMPLES_DIR, `${name}.ts`), "utf8");
            const header = text.slice(0, text.indexOf("\nimport "));
            for (const variable of [
                "CONVERGER_URL",
                "CONVERGER_AGENT_TOKEN",
                "CONVERGER_AGENT_GROUP",
            ]) {
                assert.ok(header.includes(variable), `${name}.ts documents ${variable}`);
            }
        }
    });
});
