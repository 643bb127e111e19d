-- HTTP agent groups (ADR 0031): a group of a channel whose member is every node, which POSTs each
-- turn it owns to the group's URL (AG-UI over HTTP). The secret signs each call, so it is kept as
-- given (never listed back). A turn whose calls all failed is `failed` in the registry and listed
-- once per group in the dead letters until an operator retries or drops it.

CREATE TABLE http_agents (
    channel_id      uuid        NOT NULL REFERENCES channels (id) ON DELETE CASCADE,
    group_name      text        NOT NULL,
    url             text        NOT NULL,
    secret          text,
    timeout_ms      integer     NOT NULL CHECK (timeout_ms > 0),
    max_concurrency integer     NOT NULL CHECK (max_concurrency > 0),
    retry_attempts  integer     NOT NULL CHECK (retry_attempts >= 1),
    retry_backoff_ms integer    NOT NULL CHECK (retry_backoff_ms >= 0),
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (channel_id, group_name)
);

CREATE TABLE http_agent_dead_letters (
    conversation_id uuid        NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq             bigint      NOT NULL,
    revision        integer     NOT NULL,
    channel_id      uuid        NOT NULL,
    group_name      text        NOT NULL,
    url             text        NOT NULL,
    attempts        integer     NOT NULL,
    error           text        NOT NULL,
    failed_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, seq, revision, group_name)
);
CREATE INDEX http_agent_dead_letters_channel ON http_agent_dead_letters (channel_id, failed_at);
