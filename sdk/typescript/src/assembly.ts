// Streamed answers as an end user's UI shows them (docs/protocol.md §4.9): each chunk applied
// once across reconnects, each stream ended once.

import {
    type Message,
    type Participant,
    type StreamChunk,
    type StreamEnd,
    streamEnd,
    type TurnRef,
} from "./frames.js";
import type { JsonObject } from "./json.js";

export type StreamStatus = "open" | "committed" | "aborted";

/**
 * One stream as an end user has assembled it so far (updated in place).
 *
 * `text` is the text deltas joined, `chunks` the genui chunk objects in order, `nextIndex` the
 * number of chunks applied (the next index expected). `duplicates` counts the chunks that arrived
 * again (after a reconnect) and were dropped. `turn` and `sender` come from the first chunk.
 */
export class AssembledStream {
    readonly streamId: string;
    turn: TurnRef | undefined;
    sender: Participant | undefined;
    readonly chunks: JsonObject[] = [];
    nextIndex = 0;
    status: StreamStatus = "open";
    reason: string | undefined;
    duplicates = 0;
    #text = "";
    // Per chunk applied: the length of the text up to its end, so that a coalesced chunk which
    // overlaps what was applied adds only the rest.
    readonly #textEnds: number[] = [];

    constructor(streamId: string) {
        this.streamId = streamId;
    }

    /** The text deltas applied so far, joined. */
    get text(): string {
        return this.#text;
    }

    /** Whether the stream ended (committed or aborted). */
    get ended(): boolean {
        return this.status !== "open";
    }

    /** Whether the stream ended with its answer stored. */
    get committed(): boolean {
        return this.status === "committed";
    }

    /** Applies a chunk whose range starts at or before `nextIndex` and ends after it. */
    applyRange(chunk: StreamChunk): void {
        const following = this.nextIndex;
        if (following === 0) {
            this.turn = chunk.turn;
            this.sender = chunk.sender;
        }
        // The chunks of the range that were applied already arrived again: their text is dropped.
        this.duplicates += following - chunk.firstIndex;
        let heldLength = this.#textEnds.at(-1) ?? 0;
        if (chunk.text !== undefined) {
            const runStart = chunk.firstIndex > 0 ? (this.#textEnds[chunk.firstIndex - 1] ?? 0) : 0;
            const newText = chunk.text.slice(heldLength - runStart);
            this.#text += newText;
            heldLength += newText.length;
        }
        if (chunk.chunk !== undefined) {
            this.chunks.push(chunk.chunk);
        }
        for (let index = following; index <= chunk.index; index += 1) {
            this.#textEnds.push(heldLength);
        }
        this.nextIndex = chunk.index + 1;
    }
}

/**
 * What changed in a stream: a chunk was applied (`chunk`) or the stream ended (`end`).
 *
 * `stream` is live: it may already hold later chunks when this update is read late. Repeated
 * chunks never produce an update, and each stream produces one update with `end`.
 */
export interface StreamUpdate {
    readonly streamId: string;
    readonly stream: AssembledStream;
    readonly chunk?: StreamChunk;
    readonly end?: StreamEnd;
}

/**
 * The streams of one conversation, each chunk applied once.
 *
 * A new connection is shown every open stream from index 0 again, so keep one assembly across
 * reconnects (Conversation does): {@link applyChunk} applies a chunk only when its range reaches
 * the next index of its stream, so repeats are dropped and a gap is never papered over. A stream
 * ends with its `streamEnd` ({@link applyEnd}) or with the stored answer that names it
 * ({@link applyMessage}), whichever comes first. At most `maxEnded` ended streams are kept (the
 * oldest go first); open ones are all kept.
 */
export class StreamAssembly {
    readonly #streams = new Map<string, AssembledStream>();
    readonly #ended: string[] = [];
    readonly #maxEnded: number;

    constructor(maxEnded = 1000) {
        this.#maxEnded = Math.max(maxEnded, 1);
    }

    /** Applies `chunk`; the stream when it was applied, `undefined` for a repeat or a gap. */
    applyChunk(chunk: StreamChunk): AssembledStream | undefined {
        let stream = this.#streams.get(chunk.streamId);
        if (stream === undefined) {
            if (chunk.firstIndex !== 0) {
                return undefined;
            }
            stream = new AssembledStream(chunk.streamId);
            this.#streams.set(chunk.streamId, stream);
        }
        const following = stream.nextIndex;
        if (chunk.index < following) {
            stream.duplicates += 1;
            return undefined;
        }
        if (stream.ended || chunk.firstIndex > following) {
            return undefined;
        }
        stream.applyRange(chunk);
        return stream;
    }

    /**
     * Ends a stream; the stream when this ended one that was shown, else `undefined` (it had
     * ended already, or none of it had arrived: the end is recorded so that later chunks are
     * dropped, but there is nothing to show).
     */
    applyEnd(end: StreamEnd): AssembledStream | undefined {
        let stream = this.#streams.get(end.streamId);
        const shown = stream !== undefined;
        if (stream === undefined) {
            stream = new AssembledStream(end.streamId);
            this.#streams.set(end.streamId, stream);
        } else if (stream.ended) {
            return undefined;
        }
        stream.status = end.status;
        stream.reason = end.reason;
        this.#ended.push(end.streamId);
        while (this.#ended.length > this.#maxEnded) {
            const oldest = this.#ended.shift();
            if (oldest !== undefined) {
                this.#streams.delete(oldest);
            }
        }
        return shown ? stream : undefined;
    }

    /**
     * Ends, as committed, the open stream a stored answer names (its `streamId`, else its `id`,
     * which is the stream's id unless the agent chose another); the end, or `undefined`.
     */
    applyMessage(message: Message): { stream: AssembledStream; end: StreamEnd } | undefined {
        const named = message.raw.streamId;
        for (const streamId of [named, message.id]) {
            if (typeof streamId !== "string") {
                continue;
            }
            const stream = this.#streams.get(streamId);
            if (stream === undefined || stream.ended) {
                continue;
            }
            const end = streamEnd(streamId, "committed", undefined, message.raw);
            this.applyEnd(end);
            return { stream, end };
        }
        return undefined;
    }

    /** A stream, when any of it arrived (or its end). */
    get(streamId: string): AssembledStream | undefined {
        return this.#streams.get(streamId);
    }

    has(streamId: string): boolean {
        return this.#streams.has(streamId);
    }

    /** The streams that have not ended, oldest first. */
    get open(): AssembledStream[] {
        return [...this.#streams.values()].filter((stream) => !stream.ended);
    }

    get size(): number {
        return this.#streams.size;
    }

    [Symbol.iterator](): Iterator<AssembledStream> {
        return [...this.#streams.values()][Symbol.iterator]();
    }
}
