#!/usr/bin/env node
// The Vercel AI SDK's own client, driven from the command line by the Rust integration tests.
//
//   node ai-sdk.mjs <5|6|7> send <messageId> <text>
//   node ai-sdk.mjs <5|6|7> regenerate <userMessageId> [<text>]
//   node ai-sdk.mjs <5|6|7> resume
//
// Environment: BASE (the node's URL, e.g. http://127.0.0.1:8080), TOKEN (a conversation-scope
// token), CONVERSATION (the conversation id, which is the AI SDK chat id). Optional:
// STOP_AFTER_CHUNKS=n posts BASE/api/v1/ai-sdk/chat/CONVERSATION/stop once n text-delta chunks
// have arrived, then keeps reading the stream to its end. PROGRESS=1 writes `chunk <type>` to
// stderr as each chunk is read (for a test that acts while the stream runs).
//
// Output: ONE JSON line on stdout,
//   {"chunks": [every chunk, in order], "message": <the final UIMessage, or null>}
// plus "stop": {"status", "body"} when STOP_AFTER_CHUNKS asked for a stop, or {"none": true} when
// `resume` found no answer in progress (the node answered 204). Exit 0 when the whole stream was
// read and every chunk passed the package's own checks, even if the stream carried an `error` or
// `abort` chunk (those are part of the protocol; they are in "chunks"). Exit 1 with the error on
// stderr otherwise: a 4xx answer, a chunk the package's schema rejects, a chunk the package's
// message builder rejects (e.g. a text-delta without its text-start), a broken connection.
//
// Nothing here parses the stream: the major's own DefaultChatTransport does the HTTP and the
// SSE/JSON decoding (validating every chunk with the package's uiMessageChunkSchema, and erroring
// the stream on the first chunk that fails), and the major's own readUIMessageStream builds the
// UIMessage exactly as useChat would.

const [major, mode, ...args] = process.argv.slice(2);

// One alias per major in package.json (ai5, ai6, ai7 are npm:ai@<that major>), so that one
// checkout tests all three against the same server.
const PACKAGES = { 5: 'ai5', 6: 'ai6', 7: 'ai7' };

function usage(message) {
    console.error(`ai-sdk.mjs: ${message}`);
    console.error(
        'usage: node ai-sdk.mjs <5|6|7> send <messageId> <text> | regenerate <userMessageId> [<text>] | resume',
    );
    process.exit(2);
}

function env(name) {
    const value = process.env[name];
    if (!value) usage(`${name} is not set`);
    return value;
}

if (!(major in PACKAGES)) usage(`unknown major "${major}"`);
const { DefaultChatTransport, readUIMessageStream } = await import(PACKAGES[major]);

const BASE = env('BASE').replace(/\/+$/, '');
const TOKEN = env('TOKEN');
const CONVERSATION = env('CONVERSATION');
const stopAfter = process.env.STOP_AFTER_CHUNKS ? Number(process.env.STOP_AFTER_CHUNKS) : null;
if (stopAfter !== null && !(Number.isInteger(stopAfter) && stopAfter > 0)) {
    usage('STOP_AFTER_CHUNKS must be a positive integer');
}

const authorization = { Authorization: `Bearer ${TOKEN}` };
const transport = new DefaultChatTransport({
    api: `${BASE}/api/v1/ai-sdk/chat`,
    headers: authorization,
});

// A user message as useChat builds it from sendMessage({text}): one text part.
function userMessage(id, text) {
    return { id, role: 'user', parts: text === undefined ? [] : [{ type: 'text', text }] };
}

// The stop button's server half (useChat's own stop() only aborts the fetch). Its answer goes
// into the output so that the test can check {"stopped": true, ...}.
async function postStop() {
    const response = await fetch(`${BASE}/api/v1/ai-sdk/chat/${encodeURIComponent(CONVERSATION)}/stop`, {
        method: 'POST',
        headers: { ...authorization, 'content-type': 'application/json' },
        body: '{}',
    });
    const text = await response.text();
    let body = text;
    try {
        body = JSON.parse(text);
    } catch {
        // keep the raw text: the test will show it
    }
    if (!response.ok) throw new Error(`stop answered ${response.status}: ${text}`);
    return { status: response.status, body };
}

// Reads a chunk stream the way useChat does and returns what the test needs to see.
async function read(chunkStream) {
    const chunks = [];
    // readUIMessageStream reports both real failures and the stream's own `error` chunks through
    // onError (the latter as a plain `new Error(errorText)`). An `error` chunk is protocol, not a
    // client failure, so the errorTexts of the chunks seen are remembered to tell the two apart.
    const errorTexts = [];
    const failures = [];
    let textDeltas = 0;
    let stop = null;

    // Record every chunk, in order, as the message builder pulls it: these are the objects the
    // package's schema accepted (and, for ai 7, transformed), not the raw bytes.
    const recorded = chunkStream.pipeThrough(
        new TransformStream({
            transform(chunk, controller) {
                chunks.push(chunk);
                // A test that must act while the stream runs (after a resume began) watches
                // stderr for each chunk's type.
                if (process.env.PROGRESS) process.stderr.write(`chunk ${chunk.type}\n`);
                if (chunk.type === 'error') errorTexts.push(chunk.errorText);
                if (chunk.type === 'text-delta' && ++textDeltas === stopAfter) {
                    // Not awaited: the stream must keep flowing while the stop is on its way.
                    stop = postStop();
                    // A rejected stop is reported after the stream ends, not as an unhandled one.
                    stop.catch(() => {});
                }
                controller.enqueue(chunk);
            },
        }),
    );

    let message = null;
    const messages = readUIMessageStream({
        stream: recorded,
        onError(error) {
            const index = error?.constructor === Error ? errorTexts.indexOf(error.message) : -1;
            if (index >= 0) errorTexts.splice(index, 1);
            else failures.push(error);
        },
    });
    // Every item is a snapshot of the same assistant message as it grows; the last one is final.
    for await (const snapshot of messages) message = snapshot;

    if (failures.length > 0) throw failures[0];
    const output = { chunks, message };
    if (stopAfter !== null) {
        if (stop === null) throw new Error(`the stream ended before ${stopAfter} text-delta chunks`);
        output.stop = await stop;
    }
    return output;
}

async function main() {
    const abortSignal = new AbortController().signal;
    switch (mode) {
        case 'send': {
            const [messageId, text] = args;
            if (!messageId || text === undefined) usage('send needs <messageId> <text>');
            const stream = await transport.sendMessages({
                chatId: CONVERSATION,
                messages: [userMessage(messageId, text)],
                trigger: 'submit-message',
                messageId: undefined,
                abortSignal,
            });
            return read(stream);
        }
        case 'regenerate': {
            const [userMessageId, text] = args;
            if (!userMessageId) usage('regenerate needs <userMessageId>');
            // As useChat's regenerate() sends it: the history up to the user turn to answer again.
            const stream = await transport.sendMessages({
                chatId: CONVERSATION,
                messages: [userMessage(userMessageId, text)],
                trigger: 'regenerate-message',
                messageId: undefined,
                abortSignal,
            });
            return read(stream);
        }
        case 'resume': {
            // GET {api}/{chatId}/stream: 204 gives null (nothing in progress), else the answer's SSE.
            const stream = await transport.reconnectToStream({ chatId: CONVERSATION, abortSignal });
            return stream === null ? { none: true } : read(stream);
        }
        default:
            usage(`unknown mode "${mode}"`);
    }
}

try {
    const output = await main();
    process.stdout.write(`${JSON.stringify(output)}\n`);
    // Explicit: an idle keep-alive socket must not hold the test waiting.
    process.exit(0);
} catch (error) {
    console.error('ai-sdk.mjs:', error);
    process.exit(1);
}
