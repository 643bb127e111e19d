-- Read positions for read receipts: the highest seq a participant has read, only ever raised.
CREATE TABLE conversation_reads (
    conversation_id uuid   NOT NULL REFERENCES conversations (id),
    participant_id  text   NOT NULL,
    participant_role text  NOT NULL,
    read_seq        bigint NOT NULL CHECK (read_seq >= 0),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (conversation_id, participant_id)
);

-- Channel status events have no conversation; they stay in the outbox for catch-ups.
ALTER TABLE outbox ALTER COLUMN conversation_id DROP NOT NULL;
