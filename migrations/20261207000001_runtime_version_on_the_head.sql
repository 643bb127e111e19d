-- The runtime's version on the conversation's row (ADR 0039). A batch locks the rows of its
-- conversations before anything else, and a locked row is read as its latest committed
-- version even when another batch changed it while this one waited for the lock; a row of
-- another table read in the same statement is not. The version lives where that lock reads it,
-- so every commit can tell the version its conversation committed with, without another
-- statement. `conversation_runtime` keeps the state (and the version, which stays equal).
ALTER TABLE conversations ADD COLUMN runtime_version bigint NOT NULL DEFAULT 0;

UPDATE conversations c SET runtime_version = r.version
  FROM conversation_runtime r
 WHERE r.conversation_id = c.id AND r.version <> 0;
