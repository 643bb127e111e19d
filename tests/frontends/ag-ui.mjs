#!/usr/bin/env node
// The AG-UI TypeScript client (@ag-ui/client's HttpAgent), driven from the command line by the
// Rust integration tests.
//
//   node ag-ui.mjs run <messageId> <text>
//   node ag-ui.mjs interrupt-roundtrip <messageId> <text> <payloadJSON>
//   node ag-ui.mjs resume <interruptId> <payloadJSON>
//   node ag-ui.mjs connect            (env CONNECT_UNTIL_RUNS=n: leave after n RUN_FINISHED)
//   node ag-ui.mjs stop
//
// Environment: BASE (the node's URL), TOKEN (a conversation-scope token), CONVERSATION (the
// conversation id, which is the AG-UI threadId); `run` sends FORWARDED_PROPS (JSON), if set,
// as the run's forwardedProps.
//
// Output, one JSON line on stdout:
//   run, resume:          a run report {"events", "messages", "state", "result", "pendingInterrupts"}
//   interrupt-roundtrip:  {"runs": [first run report, second run report]}
//   connect:              one line per event, written as it arrives (not one report)
//   stop:                 {"status": <HTTP status>, "body": <the node's JSON answer>}
// Exit codes: 0 fine; 1 the client failed (HTTP 4xx, an event its schema or verifier rejects, a
// stream cut before the run ended, ...), error on stderr and nothing on stdout; 3 the run ended
// with RUN_ERROR (the report IS printed, so the test can look at the error); 2 bad usage.
//
// Nothing here parses the stream. HttpAgent.runAgent does the HTTP, the SSE decoding, the schema
// enforcement (enforceEvents: unknown fields are stripped with a warning on stderr, malformed
// known fields are fatal), the ordering checks (verifyEvents, always on: there is no switch to
// turn it off) and the reduction into agent.messages / agent.state / agent.pendingInterrupts.

import { randomUUID } from 'node:crypto';
import {
    HttpAgent,
    enforceOutgoingInput,
    runHttpRequest,
    transformHttpEventStream,
} from '@ag-ui/client';

const [mode, ...args] = process.argv.slice(2);

function usage(message) {
    console.error(`ag-ui.mjs: ${message}`);
    console.error(
        'usage: node ag-ui.mjs run <messageId> <text> | interrupt-roundtrip <messageId> <text> <payloadJSON>' +
            ' | resume <interruptId> <payloadJSON> | connect | stop',
    );
    process.exit(2);
}

function env(name) {
    const value = process.env[name];
    if (!value) usage(`${name} is not set`);
    return value;
}

const BASE = env('BASE').replace(/\/+$/, '');
const TOKEN = env('TOKEN');
const CONVERSATION = env('CONVERSATION');
const authorization = { Authorization: `Bearer ${TOKEN}` };

// HttpAgent implements run() only; connect() throws AGUIConnectNotImplementedError (which
// connectAgent() swallows, ending quietly with nothing). This is HttpAgent.run, line for line,
// aimed at the connect endpoint: the same request (requestInit: POST, JSON RunAgentInput,
// Accept: text/event-stream, our headers), the same outgoing enforcement, the same SSE decoder.
class ConnectingHttpAgent extends HttpAgent {
    constructor({ connectUrl, ...config }) {
        super(config);
        this.connectUrl = connectUrl;
    }

    connect(input) {
        const httpEvents = runHttpRequest(() =>
            this.fetch(this.connectUrl, this.requestInit(enforceOutgoingInput(input))),
        );
        return transformHttpEventStream(httpEvents, this.debugLogger);
    }
}

function newAgent() {
    return new ConnectingHttpAgent({
        url: `${BASE}/api/v1/ag-ui/run`,
        connectUrl: `${BASE}/api/v1/ag-ui/connect`,
        headers: authorization,
        threadId: CONVERSATION,
    });
}

function parsePayload(json) {
    try {
        return JSON.parse(json);
    } catch (error) {
        usage(`<payloadJSON> is not JSON: ${error.message}`);
    }
}

// One runAgent() with a subscriber that keeps every event, in order, as the agent saw it (after
// enforcement and verification); then what the run left in the agent.
async function runOnce(agent, parameters) {
    const events = [];
    const { result } = await agent.runAgent(parameters, {
        onEvent({ event }) {
            events.push(event);
        },
    });
    // The client accepts a stream that simply stops (its verifier has no end-of-stream check), but
    // the contract says every run ends with RUN_FINISHED or RUN_ERROR: a cut stream is a failure.
    const last = events.at(-1)?.type;
    if (last !== 'RUN_FINISHED' && last !== 'RUN_ERROR') {
        throw new Error(`the run's stream ended after ${last ?? 'no event'}, not RUN_FINISHED or RUN_ERROR`);
    }
    return {
        events,
        messages: agent.messages,
        state: agent.state,
        result: result ?? null,
        // Set by the client from RUN_FINISHED {outcome: {type: "interrupt", interrupts}}, emptied
        // by any other RUN_FINISHED.
        pendingInterrupts: agent.pendingInterrupts,
    };
}

const erred = (report) => report.events.some((event) => event.type === 'RUN_ERROR');

function print(value) {
    process.stdout.write(`${JSON.stringify(value)}\n`);
}

async function main() {
    switch (mode) {
        case 'run': {
            const [messageId, text] = args;
            if (!messageId || text === undefined) usage('run needs <messageId> <text>');
            const agent = newAgent();
            agent.messages = [{ id: messageId, role: 'user', content: text }];
            // FORWARDED_PROPS (JSON) goes with the run, as an app passes its own props.
            const forwardedProps = process.env.FORWARDED_PROPS ? JSON.parse(process.env.FORWARDED_PROPS) : undefined;
            const report = await runOnce(agent, { runId: randomUUID(), forwardedProps });
            print(report);
            return erred(report) ? 3 : 0;
        }
        case 'interrupt-roundtrip': {
            // The whole human-in-the-loop flow in one agent, as an application does it: the first
            // run ends with an interrupt outcome, which the client keeps in pendingInterrupts; the
            // next runAgent() must then answer every pending interrupt (AbstractAgent refuses to
            // start a run that leaves one unanswered), with the history the first run left.
            const [messageId, text, payloadJSON] = args;
            if (!messageId || text === undefined || payloadJSON === undefined) {
                usage('interrupt-roundtrip needs <messageId> <text> <payloadJSON>');
            }
            const payload = parsePayload(payloadJSON);
            const agent = newAgent();
            agent.messages = [{ id: messageId, role: 'user', content: text }];
            const first = await runOnce(agent, { runId: randomUUID() });
            if (erred(first)) {
                print({ runs: [first] });
                return 3;
            }
            if (agent.pendingInterrupts.length === 0) {
                throw new Error('the first run did not end with an interrupt outcome');
            }
            const resume = agent.pendingInterrupts.map((interrupt) => ({
                interruptId: interrupt.id,
                status: 'resolved',
                payload,
            }));
            const second = await runOnce(agent, { runId: randomUUID(), resume });
            print({ runs: [first, second] });
            return erred(second) ? 3 : 0;
        }
        case 'resume': {
            // A resume from a fresh process: no history is sent and the agent has no pending
            // interrupts of its own (so the client's coverage check has nothing to check); the
            // node must accept the answer on the strength of what it stored.
            const [interruptId, payloadJSON] = args;
            if (!interruptId || payloadJSON === undefined) usage('resume needs <interruptId> <payloadJSON>');
            const payload = parsePayload(payloadJSON);
            const agent = newAgent();
            const report = await runOnce(agent, {
                runId: randomUUID(),
                resume: [{ interruptId, status: 'resolved', payload }],
            });
            print(report);
            return erred(report) ? 3 : 0;
        }
        case 'connect': {
            // Events are printed as they arrive (stdout is a pipe, and pipe writes are synchronous
            // in Node on Linux, so each line is out before the next event is handled): the test
            // reads them live, e.g. to start a run once the snapshot is there.
            const until = process.env.CONNECT_UNTIL_RUNS ? Number(process.env.CONNECT_UNTIL_RUNS) : Infinity;
            if (!(until > 0)) usage('CONNECT_UNTIL_RUNS must be a positive integer');
            const agent = newAgent();
            let finished = 0;
            let leaving = false;
            await agent.connectAgent(
                { runId: randomUUID() },
                {
                    onEvent({ event }) {
                        if (leaving) return;
                        print(event);
                        if (event.type === 'RUN_FINISHED' && ++finished >= until) {
                            leaving = true;
                            // Not awaited here: detachActiveRun() waits for the pipeline to
                            // finish, which waits for this very callback. Detaching first stops
                            // the events (and cancels the body reader); the abort then closes the
                            // request, so the node sees the client leave. Aborting first would
                            // make the client emit a synthetic RUN_ERROR {code: "abort"}.
                            setImmediate(async () => {
                                await agent.detachActiveRun();
                                agent.abortController.abort();
                            });
                        }
                    },
                },
            );
            return 0;
        }
        case 'stop': {
            const response = await fetch(`${BASE}/api/v1/ag-ui/stop`, {
                method: 'POST',
                headers: { ...authorization, 'Content-Type': 'application/json' },
                body: JSON.stringify({ threadId: CONVERSATION }),
            });
            const text = await response.text();
            let body = text;
            try {
                body = JSON.parse(text);
            } catch {
                // keep the raw text: the test will show it
            }
            if (!response.ok) throw new Error(`stop answered ${response.status}: ${text}`);
            print({ status: response.status, body });
            return 0;
        }
        default:
            usage(`unknown mode "${mode}"`);
    }
}

try {
    const code = await main();
    // Explicit: an idle keep-alive socket must not hold the test waiting.
    process.exit(code);
} catch (error) {
    console.error('ag-ui.mjs:', error);
    process.exit(1);
}
