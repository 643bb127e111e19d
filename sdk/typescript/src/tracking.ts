// What a client has already seen, so replays after a reconnect never surface a frame twice.

import { touch } from "./internal.js";

/**
 * The seqs one end user has seen in one conversation.
 *
 * The watermark is the highest seq below which nothing is missing; seqs above a gap (live frames
 * after a truncated replay) are kept one by one until the gap is filled, and the watermark sent on
 * reconnect stays below the gap so the replay fills it.
 */
export class SeqTracker {
    #contiguous: number;
    readonly #above = new Set<number>();

    constructor(watermark = 0) {
        this.#contiguous = Math.max(watermark, 0);
    }

    /** The highest seq with nothing missing below it. */
    get watermark(): number {
        return this.#contiguous;
    }

    /** Whether a seq between the watermark and the highest seen is missing. */
    get hasGap(): boolean {
        return this.#above.size > 0;
    }

    /** Whether `seq` was already observed. */
    seen(seq: number): boolean {
        return seq <= this.#contiguous || this.#above.has(seq);
    }

    /** Records `seq`; true when it had not been seen before. */
    observe(seq: number): boolean {
        if (this.seen(seq)) {
            return false;
        }
        this.#above.add(seq);
        while (this.#above.delete(this.#contiguous + 1)) {
            this.#contiguous += 1;
        }
        return true;
    }

    /** Forgets everything and starts over at `watermark`. */
    reset(watermark: number): void {
        this.#contiguous = Math.max(watermark, 0);
        this.#above.clear();
    }
}

/** Turn deliveries remembered per conversation (the most recent ones). */
export const TURNS_PER_CONVERSATION = 64;
/** Conversations remembered by a {@link ChannelTracker} by default. */
export const REMEMBERED_CONVERSATIONS = 10_000;

interface SeenConversation {
    highestSeq: number;
    /** turn seq → the highest delivery handed out, as [revision, fence] (fence -1: none). */
    turns: Map<number, [number, number]>;
}

function deliveryAtLeast(known: [number, number], delivery: [number, number]): boolean {
    return known[0] !== delivery[0] ? known[0] > delivery[0] : known[1] >= delivery[1];
}

/**
 * What an agent has seen per conversation.
 *
 * That is the highest seq (its `hello.watermarks`) and the turn deliveries handed out. Agents
 * receive only the frames they own, so seqs have gaps and a turn can arrive below the watermark
 * (a takeover, a regeneration): turns are de-duplicated by (conversation, seq, revision) and, in
 * lease mode, a redelivery under a newer claim (higher fence) counts as new. The least recently
 * active conversations are forgotten first (a Map keeps insertion order, so re-inserting an
 * entry moves it to the end).
 */
export class ChannelTracker {
    readonly #conversations = new Map<string, SeenConversation>();
    readonly #capacity: number;

    constructor(watermarks: Record<string, number> = {}, capacity = REMEMBERED_CONVERSATIONS) {
        this.#capacity = Math.max(capacity, 1);
        for (const [conversationId, seq] of Object.entries(watermarks)) {
            this.observeSeq(conversationId, seq);
        }
    }

    #touch(conversationId: string): SeenConversation {
        const seen = this.#conversations.get(conversationId) ?? {
            highestSeq: 0,
            turns: new Map(),
        };
        touch(this.#conversations, conversationId, seen, this.#capacity);
        return seen;
    }

    /** Records a delivered persistent frame's seq. */
    observeSeq(conversationId: string, seq: number): void {
        const seen = this.#touch(conversationId);
        seen.highestSeq = Math.max(seen.highestSeq, seq);
    }

    /** Records a delivered turn; true when this delivery was not handed out before. */
    firstDelivery(conversationId: string, seq: number, revision: number, fence?: number): boolean {
        const seen = this.#touch(conversationId);
        const delivery: [number, number] = [revision, fence ?? -1];
        const known = seen.turns.get(seq);
        if (known !== undefined && deliveryAtLeast(known, delivery)) {
            return false;
        }
        touch(seen.turns, seq, delivery, TURNS_PER_CONVERSATION);
        return true;
    }

    /** Forgets a handed-out turn revision (its handler failed), so a replay brings it again. */
    forgetDelivery(conversationId: string, seq: number, revision: number): void {
        const turns = this.#conversations.get(conversationId)?.turns;
        if (turns?.get(seq)?.[0] === revision) {
            turns.delete(seq);
        }
    }

    /** The highest seq of each conversation, the `limit` most recently active. */
    watermarks(limit?: number): Record<string, number> {
        const result: Record<string, number> = {};
        let count = 0;
        const newestFirst = [...this.#conversations.entries()].reverse();
        for (const [conversationId, seen] of newestFirst) {
            if (limit !== undefined && count >= limit) {
                break;
            }
            if (seen.highestSeq > 0) {
                result[conversationId] = seen.highestSeq;
                count += 1;
            }
        }
        return result;
    }
}
