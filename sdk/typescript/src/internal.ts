/**
 * Small building blocks both clients share (private to the package): an async queue, a change
 * signal, listeners, timers that a close can cut short, and the answer clientId scheme.
 */

/**
 * The clientId of a turn's answer, the same for every resend of it.
 *
 * `result-<conversation as 32 hex digits>-<seq>-<revision>` (the Rust client's and the Python
 * SDK's scheme), plus `-f<fence>` in lease mode, so the answers of two claims of one turn are
 * told apart.
 */
export function resultClientId(
    conversationId: string,
    seq: number,
    revision: number,
    fence: number | undefined,
): string {
    const compact = /^[0-9a-fA-F-]{36}$/.test(conversationId)
        ? conversationId.replaceAll("-", "").toLowerCase()
        : conversationId.replace(/[^A-Za-z0-9]/g, "").slice(0, 64);
    const clientId = `result-${compact}-${seq}-${revision}`;
    return fence === undefined ? clientId : `${clientId}-f${fence}`;
}

interface QueueWaiter<T> {
    resolve: (result: IteratorResult<T, undefined>) => void;
    reject: (error: unknown) => void;
}

/**
 * A FIFO that producers push to and consumers pull from, until it is closed: then every
 * pending and later pull ends (with the closing error, if any) once what was queued is read.
 * A bounded queue drops its oldest unread item when a push would exceed the capacity, so a
 * consumer that stopped reading cannot grow memory without bound.
 */
export class AsyncQueue<T> {
    #items: T[] = [];
    readonly #waiters: QueueWaiter<T>[] = [];
    readonly #capacity: number;
    #closed = false;
    #error: unknown = undefined;

    constructor(capacity = Number.POSITIVE_INFINITY) {
        this.#capacity = Math.max(capacity, 1);
    }

    push(item: T): void {
        if (this.#closed) {
            return;
        }
        const waiter = this.#waiters.shift();
        if (waiter !== undefined) {
            waiter.resolve({ value: item, done: false });
            return;
        }
        this.#items.push(item);
        if (this.#items.length > this.#capacity) {
            this.#items.shift();
        }
    }

    /** Drops what is queued and not read yet. */
    clear(): void {
        this.#items = [];
    }

    /** Ends the queue: readers get what is queued, then the end (or `error`). */
    close(error?: unknown): void {
        if (this.#closed) {
            return;
        }
        this.#closed = true;
        this.#error = error;
        for (const waiter of this.#waiters.splice(0)) {
            this.#finish(waiter);
        }
    }

    next(): Promise<IteratorResult<T, undefined>> {
        return new Promise((resolve, reject) => this.#pull({ resolve, reject }));
    }

    /** {@link next}, or `"timeout"` after `timeoutMs` (the pull is then withdrawn: no item is lost). */
    nextWithin(timeoutMs: number): Promise<IteratorResult<T, undefined> | "timeout"> {
        return new Promise((resolve, reject) => {
            const waiter: QueueWaiter<T> = {
                resolve: (result) => {
                    clearTimeout(timer);
                    resolve(result);
                },
                reject: (error) => {
                    clearTimeout(timer);
                    reject(error);
                },
            };
            const timer = setTimeout(
                () => {
                    const index = this.#waiters.indexOf(waiter);
                    if (index >= 0) {
                        this.#waiters.splice(index, 1);
                    }
                    resolve("timeout");
                },
                Math.max(timeoutMs, 0),
            );
            this.#pull(waiter);
        });
    }

    #pull(waiter: QueueWaiter<T>): void {
        if (this.#items.length > 0) {
            waiter.resolve({ value: this.#items.shift() as T, done: false });
            return;
        }
        if (this.#closed) {
            this.#finish(waiter);
            return;
        }
        this.#waiters.push(waiter);
    }

    #finish(waiter: QueueWaiter<T>): void {
        if (this.#error !== undefined) {
            waiter.reject(this.#error);
            return;
        }
        waiter.resolve({ value: undefined, done: true });
    }
}

/** Something that happened to a connection: waiters are woken on every change. */
export class ChangeSignal {
    #waiters: Array<() => void> = [];

    /** Resolves at the next {@link notify}. */
    next(): Promise<void> {
        return new Promise((resolve) => this.#waiters.push(resolve));
    }

    notify(): void {
        for (const wake of this.#waiters.splice(0)) {
            wake();
        }
    }
}

/**
 * The listeners of a client's `on(kind, listener)`, per kind of `Events`. Listeners run
 * synchronously in the order they were added; one that throws is reported to `failed` and the
 * others still run.
 */
export class Listeners<Events> {
    readonly #sets = new Map<keyof Events, Set<(value: never) => void>>();
    readonly #failed: (kind: keyof Events, error: unknown) => void;

    constructor(failed: (kind: keyof Events, error: unknown) => void) {
        this.#failed = failed;
    }

    /** Adds `listener` for `kind`; returns the function that removes it. */
    on<Kind extends keyof Events>(kind: Kind, listener: (value: Events[Kind]) => void): () => void {
        let set = this.#sets.get(kind);
        if (set === undefined) {
            set = new Set();
            this.#sets.set(kind, set);
        }
        const stored = listener as (value: never) => void;
        set.add(stored);
        return () => {
            set.delete(stored);
        };
    }

    /** Whether any listener of `kind` is set. */
    has(kind: keyof Events): boolean {
        return (this.#sets.get(kind)?.size ?? 0) > 0;
    }

    /** Calls every listener of `kind` with `value`. */
    emit<Kind extends keyof Events>(kind: Kind, value: Events[Kind]): void {
        const set = this.#sets.get(kind);
        if (set === undefined || set.size === 0) {
            return; // the common case on the per-frame path: no copy to make
        }
        // A copy: a listener may remove itself (or add another) while this runs.
        for (const listener of [...set]) {
            try {
                (listener as (value: Events[Kind]) => void)(value);
            } catch (error) {
                this.#failed(kind, error);
            }
        }
    }
}

/**
 * Waits until `ready()` gives a value, checking it again at every change of `changed`; throws
 * what `ready()` throws (a client that stopped) and `timeoutError()` after `timeoutMs`.
 */
export async function waitUntil<T>(
    changed: ChangeSignal,
    ready: () => T | undefined,
    timeoutMs: number,
    timeoutError: () => Error,
): Promise<T> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
        const value = ready();
        if (value !== undefined) {
            return value;
        }
        const remaining = deadline - Date.now();
        if (remaining <= 0) {
            throw timeoutError();
        }
        await within(changed.next(), remaining, timeoutError).catch(() => undefined);
    }
}

/** A promise that resolves after `ms` milliseconds. */
export function delay(ms: number): Promise<void> {
    return new Promise((resolve) => setTimeout(resolve, Math.max(ms, 0)));
}

/**
 * Resolves after `ms` milliseconds, or as soon as `signal` aborts (a client's close), so a
 * reconnect loop's backoff never outlives the client; the timer and listener are removed either way.
 */
export function sleep(ms: number, signal: AbortSignal): Promise<void> {
    if (signal.aborted) {
        return Promise.resolve();
    }
    return new Promise((resolve) => {
        const done = (): void => {
            clearTimeout(timer);
            signal.removeEventListener("abort", done);
            resolve();
        };
        const timer = setTimeout(done, Math.max(ms, 0));
        signal.addEventListener("abort", done, { once: true });
    });
}

/** Races `promise` against a timer: `onTimeout()` is thrown once `ms` passed (null: never). */
export async function within<T>(
    promise: Promise<T>,
    ms: number | null,
    onTimeout: () => Error,
): Promise<T> {
    if (ms === null || !Number.isFinite(ms)) {
        return promise;
    }
    let timer: ReturnType<typeof setTimeout> | undefined;
    const timeout = new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(onTimeout()), Math.max(ms, 0));
    });
    try {
        return await Promise.race([promise, timeout]);
    } finally {
        clearTimeout(timer);
    }
}

/** Moves `key` to the most recent end of `map` and drops the oldest entries above `capacity`. */
export function touch<K, V>(map: Map<K, V>, key: K, value: V, capacity: number): void {
    map.delete(key);
    map.set(key, value);
    while (map.size > capacity) {
        const oldest = map.keys().next();
        if (oldest.done === true) {
            break;
        }
        map.delete(oldest.value);
    }
}

/** Counts the places of a pool: at most `size` holders at once, the others wait in order. */
export class Semaphore {
    #free: number;
    readonly #waiting: Array<() => void> = [];

    constructor(size: number) {
        this.#free = size;
    }

    async acquire(): Promise<void> {
        if (this.#free > 0) {
            this.#free -= 1;
            return;
        }
        await new Promise<void>((resolve) => this.#waiting.push(resolve));
    }

    release(): void {
        const next = this.#waiting.shift();
        if (next !== undefined) {
            // The place passes straight to the next waiter.
            next();
            return;
        }
        this.#free += 1;
    }
}
