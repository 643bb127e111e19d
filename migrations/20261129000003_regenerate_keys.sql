-- A regenerate stores nothing but a registry row; its clientId makes resends idempotent.
ALTER TABLE turns ADD COLUMN client_id text;
CREATE UNIQUE INDEX turns_client_id ON turns (conversation_id, client_id) WHERE client_id IS NOT NULL;
