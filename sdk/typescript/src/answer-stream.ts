// Streamed answers, the agent's side (docs/protocol.md §4.9): `turn.stream()` opens an
// AnswerStream; its chunks reach every end-user connection of the conversation at once (never
// stored, never acknowledged) and it ends with the turn's committed answer (`finish()`) or an
// abort.
//
//     const stream = turn.stream();
//     for await (const word of model.generate(turn.text)) await stream.write(word);
//     await stream.finish(); // commits the streamed text as the turn's answer
//
// `turn.streamWith(async (stream) => …)` does the same and ends the stream as a `finally`
// would (see AnswerStream.end).

import { FrameTooLarge, type ServerError, StaleRuntime, StreamInterrupted } from "./errors.js";
import { byteLength, type JsonObject, stringify } from "./json.js";

/** `open`, `finished` ({@link AnswerStream.finish} was called) or `aborted`. */
export type AnswerStreamState = "open" | "finished" | "aborted";

/** What a stream needs of the turn it answers (implemented by the agent's `Turn`). */
export interface StreamedTurn<Answered> {
    readonly conversationId: string;
    readonly seq: number;
    readonly revision: number;
    readonly fence: number | undefined;
    readonly key: string;
    readonly cancelled: boolean;
    /** The ack of the turn's answer, once it was answered. */
    readonly ack: Answered | undefined;
    /** Commits the turn's answer (resent until acked). */
    answer(
        frames: readonly JsonObject[],
        runtime?: JsonObject,
        options?: AnswerOptions,
    ): Promise<Answered>;
}

/** What a stream needs of the agent connection it writes to (implemented by `Agent`). */
export interface StreamHost {
    /** How many connections were welcomed so far: a change means the server aborted the stream. */
    readonly connections: number;
    readonly connected: boolean;
    /** `maxFrameBytes` of the current welcome. */
    readonly maxFrameBytes: number;
    /** Throws when the agent stopped for good (fatal close, closed). */
    requireAlive(): void;
    /** Writes an enveloped frame on the open socket, waiting for room in its buffer; false when down. */
    writeEnvelope(conversationId: string, frame: JsonObject): Promise<boolean>;
    /** Writes a frame already serialised (a chunk, measured first), as `writeEnvelope`. */
    writeText(text: string): Promise<boolean>;
    /** Called once the stream ended, so its refusals are no longer routed to it. */
    forgetStream(stream: AnswerStream<unknown>): void;
    /** Records why something went wrong, for the operator. */
    warn(message: string): void;
}

/** Options of {@link AnswerStream.finish} and of `turn.answer()`. */
export interface AnswerOptions {
    /** How long to wait for the ack, in ms (default 120 000; `null`: as long as the agent lives). */
    timeoutMs?: number | null;
    /**
     * The runtime version the new state is written against (default: the turn's `runtime.version`,
     * which is the newest this agent knows of).
     */
    runtimeVersion?: number;
}

/**
 * A streamed answer an agent writes for one delivered turn; make one with `turn.stream()`.
 *
 * {@link write} sends a text delta and {@link chunk} a UI (genui) chunk object, each as the next
 * `streamChunk` (the first one names the turn, with its fence in lease mode). Chunks are not
 * acknowledged: the answer becomes durable with {@link finish}, which commits the turn's result
 * through the same resend-until-acked path as `turn.answer()` and ends the stream for every
 * viewer; {@link abort} ends it without an answer.
 *
 * Errors:
 * - a chunk written while the connection is down, or after it dropped since the stream opened,
 *   throws {@link StreamInterrupted} (the server aborted the stream when the connection ended).
 *   The turn can still be answered: `finish()` and `turn.answer()` are resent until acked over
 *   the next connection.
 * - a chunk the server refused is answered by an `error` frame after the call that sent it has
 *   returned: the refusal is kept in {@link refusal} and thrown, typed, by every later
 *   {@link write} and {@link chunk}. {@link finish} does not throw it: the turn registry decides
 *   whether the answer commits and refuses with its own typed error.
 *
 * Flow control: a write waits while the socket's send buffer is full, so a fast producer is
 * paced by the network. Chunks count against the node's `maxFramesPerSec`: stream words or
 * sentences, not characters.
 */
export class AnswerStream<Answered = unknown> {
    readonly streamId: string;
    readonly turn: StreamedTurn<Answered>;
    #host: StreamHost;
    #index = 0;
    #parts: string[] = [];
    /** The host's connection count when index 0 went out. */
    #openedOn: number | undefined;
    #state: AnswerStreamState = "open";
    #refusal: ServerError | undefined;
    #raised: Error | undefined;
    #ack: Answered | undefined;
    /** Serializes sends so indexes go out in order even when calls are not awaited. */
    #queue: Promise<unknown> = Promise.resolve();

    constructor(host: StreamHost, turn: StreamedTurn<Answered>, streamId: string) {
        this.#host = host;
        this.turn = turn;
        this.streamId = streamId;
    }

    /** The turn's conversation. */
    get conversationId(): string {
        return this.turn.conversationId;
    }

    /** The text deltas sent so far, joined (what `finish()` commits by default). */
    get streamedText(): string {
        return this.#parts.join("");
    }

    /** How many chunks were written (the next chunk's index). */
    get chunksSent(): number {
        return this.#index;
    }

    get state(): AnswerStreamState {
        return this.#state;
    }

    /** The server's refusal of one of this stream's chunks, once one arrived. */
    get refusal(): ServerError | undefined {
        return this.#refusal;
    }

    /** The error one of this stream's calls threw, once one did. */
    get failure(): Error | undefined {
        return this.#raised;
    }

    /** The ack of the committed answer, once {@link finish} succeeded. */
    get ack(): Answered | undefined {
        return this.#ack;
    }

    /**
     * Sends `delta` as the next text chunk (an empty delta sends nothing).
     *
     * Throws {@link StreamInterrupted} when the connection is down or dropped since the stream
     * opened, the stream's {@link refusal} once one arrived, {@link FrameTooLarge} for a chunk
     * above `maxFrameBytes` (not sent; the stream goes on), and an `Error` after
     * {@link finish} or {@link abort}.
     */
    async write(delta: string): Promise<void> {
        if (typeof delta !== "string") throw new TypeError("a text delta is a string");
        if (delta === "") return;
        await this.#serialized(() => this.#send("text", delta));
    }

    /** Sends a UI (genui) chunk object, shown to end users as it is, as the next chunk. */
    async chunk(chunk: JsonObject): Promise<void> {
        await this.#serialized(() => this.#send("chunk", { ...chunk }));
    }

    /**
     * Commits the turn's answer and so ends the stream (`streamEnd` committed).
     *
     * `frames` are the frames to store, as for `turn.answer()`; each frame with neither `id` nor
     * `streamId` gets `streamId`, so the server stores it with the stream's id as its `id` (a UI
     * that keyed the streamed bubble by it replaces that bubble). Without `frames` it commits one
     * `text` frame holding everything streamed so far ({@link streamedText}, which must then not
     * be empty). The answer is resent with the turn's clientId until acknowledged, also after a
     * reconnect, so it commits even when the connection dropped mid-stream.
     *
     * After {@link StaleRuntime}, {@link FrameTooLarge} or a `TypeError`/`RangeError` (nothing
     * stored) the stream stays open: finish again, or abort.
     */
    async finish(
        frames?: readonly JsonObject[],
        runtime?: JsonObject,
        options: AnswerOptions = {},
    ): Promise<Answered> {
        return this.#serialized(async () => {
            this.#requireOpen();
            let bodies: JsonObject[];
            if (frames === undefined) {
                if (this.#parts.length === 0) {
                    throw new RangeError(
                        `stream ${this.streamId} streamed no text: pass the frames to commit`,
                    );
                }
                bodies = [{ type: "text", data: { text: this.streamedText } }];
            } else {
                bodies = frames.map((frame) => ({ ...frame }));
            }
            for (const body of bodies) {
                if (!("id" in body) && !("streamId" in body)) body.streamId = this.streamId;
            }
            this.#state = "finished";
            let ack: Answered;
            try {
                ack = await this.turn.answer(bodies, runtime, options);
            } catch (error) {
                if (
                    error instanceof FrameTooLarge ||
                    error instanceof StaleRuntime ||
                    error instanceof TypeError ||
                    error instanceof RangeError
                ) {
                    // Nothing was stored and the server keeps the stream open: finish again (against
                    // the current runtime, for StaleRuntime), or abort.
                    this.#state = "open";
                } else {
                    this.#host.forgetStream(this);
                }
                throw error;
            }
            this.#host.forgetStream(this);
            this.#ack = ack;
            return ack;
        });
    }

    /**
     * Ends the stream without an answer (`streamEnd` aborted with `reason`, shown to end users;
     * the server keeps 64 characters). Nothing is sent when the stream never opened or the
     * server already aborted it (its connection dropped). The turn stays unanswered. A second
     * abort does nothing; an abort after {@link finish} throws.
     */
    async abort(reason = "agent"): Promise<void> {
        await this.#serialized(async () => {
            if (this.#state === "aborted") return;
            this.#requireOpen();
            this.#state = "aborted";
            this.#host.forgetStream(this);
            if (this.#index > 0 && this.#openedOn === this.#host.connections) {
                await this.#host.writeEnvelope(this.conversationId, {
                    type: "streamAbort",
                    streamId: this.streamId,
                    reason,
                });
            }
        });
    }

    /**
     * Ends the stream the way leaving a block that used it should: after `error` (anything a
     * caller caught) it aborts with reason `error`; otherwise it finishes with the streamed text,
     * unless a call of the stream already failed (a partial answer is never committed
     * implicitly), the turn was cancelled (the stop ended the stream already) or answered with
     * `turn.answer()` meanwhile. Used by `turn.streamWith()`; does nothing once the stream ended.
     */
    async end(error?: unknown): Promise<void> {
        if (this.#state !== "open") return;
        if (this.turn.cancelled) {
            this.#state = "aborted";
            this.#host.forgetStream(this);
            return;
        }
        if (error !== undefined) {
            await this.abort("error").catch(() => undefined);
            return;
        }
        if (this.turn.ack !== undefined) {
            // The turn was answered with turn.answer(): its result ended this stream.
            this.#state = "finished";
            this.#host.forgetStream(this);
            return;
        }
        if (this.#raised !== undefined) {
            this.#host.warn(
                `stream ${this.streamId} ended after ${this.#raised.message} without finish(): aborted, turn ${this.turn.key} left unanswered`,
            );
            await this.abort("error");
            return;
        }
        if (this.#parts.length === 0) {
            await this.abort("error");
            throw new RangeError(
                `stream ${this.streamId} ended without finish() and streamed no text: call finish(frames) or abort()`,
            );
        }
        await this.finish();
    }

    /** @internal Records the server's refusal of a chunk (called by the agent's reader). */
    refused(error: ServerError): void {
        if (this.#refusal !== undefined) return;
        this.#refusal = error;
        this.#host.warn(`stream ${this.streamId} refused: ${error.message}`);
    }

    #requireOpen(): void {
        if (this.#state !== "open") throw new Error(`stream ${this.streamId} is ${this.#state}`);
    }

    #fail(error: Error): Error {
        this.#raised = error;
        return error;
    }

    #serialized<T>(operation: () => Promise<T>): Promise<T> {
        const run = this.#queue.then(operation, operation);
        this.#queue = run.catch(() => undefined);
        return run;
    }

    async #send(field: "text" | "chunk", content: string | JsonObject): Promise<void> {
        this.#requireOpen();
        const host = this.#host;
        host.requireAlive();
        if (this.#refusal !== undefined) throw this.#fail(this.#refusal);
        const connection = host.connections;
        if (!host.connected) {
            throw this.#fail(
                new StreamInterrupted(this.conversationId, this.streamId, "not connected"),
            );
        }
        if (this.#openedOn !== undefined && connection !== this.#openedOn) {
            throw this.#fail(
                new StreamInterrupted(
                    this.conversationId,
                    this.streamId,
                    "the connection dropped since the stream opened; the server aborted it",
                ),
            );
        }
        const frame: JsonObject = {
            type: "streamChunk",
            streamId: this.streamId,
            index: this.#index,
        };
        if (this.#index === 0) {
            const turn: JsonObject = { seq: this.turn.seq, revision: this.turn.revision };
            if (this.turn.fence !== undefined) turn.fence = this.turn.fence;
            frame.turn = turn;
        }
        frame[field] = content;
        // Serialised once per chunk: measured against the limit, then written as it is.
        const text = stringify({ conversationId: this.conversationId, frame });
        const size = byteLength(text);
        if (size > host.maxFrameBytes) throw new FrameTooLarge(size, host.maxFrameBytes);
        if (!(await host.writeText(text))) {
            throw this.#fail(
                new StreamInterrupted(this.conversationId, this.streamId, "the connection dropped"),
            );
        }
        if (this.#index === 0) this.#openedOn = connection;
        this.#index += 1;
        if (typeof content === "string") this.#parts.push(content);
    }
}
