// JSON values as the wire carries them, and small readers that narrow `unknown` safely.

/** Any JSON value. */
export type JsonValue =
    | string
    | number
    | boolean
    | null
    | JsonValue[]
    | { [key: string]: JsonValue };

/** A decoded JSON object. Values stay `unknown` until read with the helpers below. */
export type JsonObject = { [key: string]: unknown };

/** Whether `value` is a plain JSON object (not an array, not null). */
export function isObject(value: unknown): value is JsonObject {
    return typeof value === "object" && value !== null && !Array.isArray(value);
}

/** `value` when it is a JSON object, else an empty one. */
export function asObject(value: unknown): JsonObject {
    return isObject(value) ? value : {};
}

/** `value` when it is an integer, else `undefined`. */
export function asInt(value: unknown): number | undefined {
    return typeof value === "number" && Number.isInteger(value) ? value : undefined;
}

/** `value` when it is a string, else `undefined`. */
export function asString(value: unknown): string | undefined {
    return typeof value === "string" ? value : undefined;
}

/** `value` when it is a boolean, else `undefined`. */
export function asBoolean(value: unknown): boolean | undefined {
    return typeof value === "boolean" ? value : undefined;
}

/** The integers of `value` when it is an array (other items skipped), else an empty array. */
export function asIntArray(value: unknown): number[] {
    if (!Array.isArray(value)) {
        return [];
    }
    return value.filter((item): item is number => asInt(item) !== undefined);
}

/** The strings of `value` when it is an array (other items skipped), else an empty array. */
export function asStringArray(value: unknown): string[] {
    if (!Array.isArray(value)) {
        return [];
    }
    return value.filter((item): item is string => typeof item === "string");
}

/** Decodes one WebSocket text message; `undefined` when it is not a JSON object. */
export function parseObject(text: string): JsonObject | undefined {
    try {
        const value: unknown = JSON.parse(text);
        return isObject(value) ? value : undefined;
    } catch {
        return undefined;
    }
}

/** Serializes compactly, as one WebSocket text message. */
export function stringify(value: unknown): string {
    return JSON.stringify(value);
}

const encoder = new TextEncoder();

/** The UTF-8 size of `text` in bytes (the unit of the server's frame limits). */
export function byteLength(text: string): number {
    return encoder.encode(text).byteLength;
}
