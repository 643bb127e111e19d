-- converger schema, version 1. See DESIGN.md section 3 and docs/adr/0002-one-statement-commit.md.

CREATE TABLE tenants (
    id           uuid PRIMARY KEY,
    name         text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    -- sha256 of the API key; the key itself is shown once at creation.
    api_key_hash text NOT NULL UNIQUE,
    status       text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'inactive')),
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE channels (
    id          uuid PRIMARY KEY,
    tenant_id   uuid NOT NULL REFERENCES tenants (id),
    name        text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    -- sha256 of the channel secret; the secret itself is shown once at creation.
    secret_hash text NOT NULL UNIQUE,
    status      text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'inactive')),
    -- latest published catalogs and channel-wide defaults (later issues)
    settings    jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX channels_by_tenant ON channels (tenant_id, created_at);

CREATE TABLE conversations (
    id         uuid PRIMARY KEY,
    tenant_id  uuid NOT NULL REFERENCES tenants (id),
    channel_id uuid NOT NULL REFERENCES channels (id),
    user_id    text NOT NULL,
    status     text NOT NULL DEFAULT 'open' CHECK (status IN ('open', 'closed')),
    -- the head: seq is allocated by incrementing this under the row lock
    last_seq   bigint NOT NULL DEFAULT 0 CHECK (last_seq >= 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX conversations_by_channel ON conversations (channel_id, created_at);

CREATE TABLE activities (
    conversation_id uuid   NOT NULL REFERENCES conversations (id),
    seq             bigint NOT NULL CHECK (seq >= 1),
    -- activity id: server uuid v7, or the id an agent supplied (interrupt ids repeat)
    id              text   NOT NULL,
    type            text   NOT NULL,
    sender_id       text   NOT NULL,
    sender_role     text   NOT NULL CHECK (sender_role IN ('user', 'bot', 'agent', 'system')),
    data            jsonb  NOT NULL,
    metadata        jsonb,
    -- every other top-level field of the frame as the sender gave it
    extra           jsonb,
    client_id       text,
    -- the turn this frame answers (agent results), when any
    turn_seq        bigint,
    turn_revision   integer,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, seq)
);
-- idempotency key: (conversation, sender, clientId)
CREATE UNIQUE INDEX activities_idempotency
    ON activities (conversation_id, sender_id, client_id) WHERE client_id IS NOT NULL;
CREATE INDEX activities_by_id ON activities (conversation_id, id);

CREATE TABLE turns (
    conversation_id    uuid    NOT NULL,
    seq                bigint  NOT NULL,
    revision           integer NOT NULL DEFAULT 0 CHECK (revision >= 0),
    status             text    NOT NULL DEFAULT 'pending'
                               CHECK (status IN ('pending', 'completed', 'failed')),
    -- 'edit' or 'regenerate' for revision > 0
    reason             text,
    -- seq of the frame that created this revision (the edit's own seq)
    source_seq         bigint,
    result_fingerprint text,
    result_ids         text[],
    result_seqs        bigint[],
    -- lease mode (later issue): fencing token, holder and expiry
    fence              bigint  NOT NULL DEFAULT 0,
    claimed_by         text,
    lease_until        timestamptz,
    created_at         timestamptz NOT NULL DEFAULT now(),
    completed_at       timestamptz,
    PRIMARY KEY (conversation_id, seq, revision),
    FOREIGN KEY (conversation_id, seq) REFERENCES activities (conversation_id, seq)
);
CREATE INDEX turns_pending ON turns (conversation_id, seq) WHERE status = 'pending';

CREATE TABLE conversation_runtime (
    conversation_id uuid PRIMARY KEY REFERENCES conversations (id),
    version         bigint NOT NULL DEFAULT 0 CHECK (version >= 0),
    state           jsonb  NOT NULL DEFAULT '{}'::jsonb,
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- Committed events for the cross-node bus. A persistent event names a seq range; a transient
-- one carries its payload. Pruned after a retention window.
CREATE TABLE outbox (
    id              bigserial PRIMARY KEY,
    conversation_id uuid NOT NULL,
    seq_from        bigint,
    seq_to          bigint,
    payload         jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((seq_from IS NOT NULL AND seq_to IS NOT NULL AND seq_from <= seq_to) OR payload IS NOT NULL)
);
CREATE INDEX outbox_by_time ON outbox (created_at);
