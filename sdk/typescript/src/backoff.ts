// Reconnect delays: exponential backoff with full jitter, floored by the server's hint.

/** Server hints above this many milliseconds count as this, so a bad hint cannot park a client. */
export const LONGEST_SERVER_HINT_MS = 300_000;

export interface BackoffOptions {
    /** Ceiling of the first attempt's delay, in ms (default 500). */
    initialMs?: number;
    /** Largest ceiling any attempt reaches, in ms (default 30 000). */
    maximumMs?: number;
    /** Consecutive failures after which reconnecting stops (default: never). */
    maxAttempts?: number;
}

/**
 * How long to wait before each reconnect attempt.
 *
 * Attempt `n` (0-based, counting consecutive failures) waits a random delay in
 * `[0, min(initialMs * 2**n, maximumMs)]` ("full jitter"), so the clients of a draining node do
 * not all come back at the same moment. A `retryAfterMs` from the server (the JSON reason of a
 * 1012 or 4503 close, `error.data.retryAfterMs`, an HTTP 503 `Retry-After`) is a floor.
 * When `maxAttempts` consecutive attempts failed the client stops with {@link GaveUp}.
 */
export class Backoff {
    readonly initialMs: number;
    readonly maximumMs: number;
    readonly maxAttempts: number | undefined;

    constructor(options: BackoffOptions = {}) {
        this.initialMs = options.initialMs ?? 500;
        this.maximumMs = options.maximumMs ?? 30_000;
        this.maxAttempts = options.maxAttempts;
    }

    /** The largest delay of attempt `attempt`: `initialMs * 2**attempt`, capped. */
    ceiling(attempt: number): number {
        if (attempt >= 64) {
            return this.maximumMs;
        }
        return Math.min(this.initialMs * 2 ** Math.max(attempt, 0), this.maximumMs);
    }

    /** The delay before attempt `attempt` in ms, never shorter than `retryAfterMs`. */
    delay(attempt: number, retryAfterMs?: number, random: () => number = Math.random): number {
        const unit = Math.min(Math.max(random(), 0), 1);
        const jittered = this.ceiling(attempt) * unit;
        if (retryAfterMs === undefined || retryAfterMs <= 0) {
            return jittered;
        }
        return Math.max(jittered, Math.min(retryAfterMs, LONGEST_SERVER_HINT_MS));
    }

    /** Whether `failures` consecutive failures use up the attempts. */
    exhausted(failures: number): boolean {
        return this.maxAttempts !== undefined && failures >= this.maxAttempts;
    }
}
