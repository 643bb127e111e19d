-- The tables every turn writes keep their keys and unique indexes, which carry the promises
-- (gap-free seq, idempotency keys, one answer per turn revision), and lose their CHECK
-- constraints and the foreign keys every turn checks (conversations keeps its references to
-- tenants and channels, checked only when a conversation is created). Postgres re-parses a table's CHECK expressions at the start of
-- every statement that writes it and runs a foreign-key query per inserted row; measured under
-- `converger-bench turns`, the two were about a sixth of the database's CPU time. The only
-- writers are the store's statements and functions, which write these columns from closed sets
-- (docs/adr/0011-hot-path-schema.md).
ALTER TABLE conversations DROP CONSTRAINT conversations_last_seq_check;
ALTER TABLE conversations DROP CONSTRAINT conversations_status_check;
ALTER TABLE activities DROP CONSTRAINT activities_conversation_id_fkey;
ALTER TABLE activities DROP CONSTRAINT activities_sender_role_check;
ALTER TABLE activities DROP CONSTRAINT activities_seq_check;
ALTER TABLE turns DROP CONSTRAINT turns_conversation_id_seq_fkey;
ALTER TABLE turns DROP CONSTRAINT turns_revision_check;
ALTER TABLE turns DROP CONSTRAINT turns_status_check;
ALTER TABLE conversation_runtime DROP CONSTRAINT conversation_runtime_conversation_id_fkey;
ALTER TABLE conversation_runtime DROP CONSTRAINT conversation_runtime_version_check;
ALTER TABLE outbox DROP CONSTRAINT outbox_check;
