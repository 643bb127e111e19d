-- The batch write before ADR 0037 was one call of converger_commit_batch (and, for a batch one
-- of whose writes failed, converger_commit_batch_isolated, which called it once per write).
-- Since ADR 0037 the store writes a batch with plain statements; the two functions stayed in
-- the schema for one release, so that nodes of the release before it kept committing during a
-- rolling upgrade (docs/operations.md). No release since calls them, nor
-- converger_notify_committed, which only converger_commit_batch called. converger_batch_answer
-- stays: the settlement of a stopped turn still commits through it (ADR 0028).
DROP FUNCTION IF EXISTS converger_commit_batch_isolated(jsonb);
DROP FUNCTION IF EXISTS converger_commit_batch(jsonb);
DROP FUNCTION IF EXISTS converger_notify_committed(bigint, jsonb[]);
