// The converger SDK: end users' conversations, agents, the REST API, and the wire types.

export * from "./agent.js";
export * from "./answer-stream.js";
export * from "./assembly.js";
export * from "./backoff.js";
export * from "./connection.js";
export * from "./conversation.js";
export * from "./errors.js";
export * from "./frames.js";
export * from "./json.js";
export * from "./rest.js";
/** The frame types generated from the JSON Schemas (docs/protocol/schemas). */
export type * as schema from "./schema.js";
export * from "./shapes.js";
export * from "./tracking.js";
