// Shapes both clients share: frames to store, the clientId shape, fresh ids.

import { isObject, type JsonObject } from "./json.js";

/** A frame to store: a whole message frame object, or a string for `{"type": "text", …}`. */
export type FrameLike = string | JsonObject;

const CLIENT_ID = /^[A-Za-z0-9._:~-]{1,128}$/;

/** Whether `clientId` has the protocol's clientId shape (1 to 128 of `A-Za-z0-9._:~-`). */
export function isValidClientId(clientId: string): boolean {
    return CLIENT_ID.test(clientId);
}

/** A frame object from a {@link FrameLike} (a shallow copy; strings become `text` frames). */
export function frameOf(frame: FrameLike): JsonObject {
    if (typeof frame === "string") {
        return { type: "text", data: { text: frame } };
    }
    if (isObject(frame)) {
        return { ...frame };
    }
    throw new TypeError("a frame is a string or an object");
}

/** Frame objects from one frame or many. */
export function framesOf(frames: FrameLike | readonly FrameLike[]): JsonObject[] {
    return Array.isArray(frames) ? frames.map(frameOf) : [frameOf(frames as FrameLike)];
}

/**
 * 32 random hex digits. `crypto.getRandomValues` rather than `randomUUID`, which browsers
 * offer only in secure contexts.
 */
export function randomHex(): string {
    const bytes = new Uint8Array(16);
    globalThis.crypto.getRandomValues(bytes);
    return Array.from(bytes, (byte) => byte.toString(16).padStart(2, "0")).join("");
}
