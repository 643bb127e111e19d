-- A group-commit batch in one round trip (ADR 0011). It used to be BEGIN, one statement per
-- write, then COMMIT: per write, a round trip and a statement start on both sides.
--
-- converger_commit_frame: one frame, as the statement in crates/store/src/activities.rs used to
-- do it. It allocates the seq under the conversation row lock, inserts the activity, the turn
-- row for user frames and the outbox row, and notifies. No row when the conversation is missing
-- or closed; the original row with duplicate = true when the idempotency key was used before.
-- The timestamp is read after the row lock is held, so within a conversation it never goes
-- backwards as seq grows.
CREATE FUNCTION converger_commit_frame(
    p_conversation uuid,
    p_id           text,
    p_kind         text,
    p_sender_id    text,
    p_sender_role  text,
    p_data         jsonb,
    p_metadata     jsonb,
    p_extra        jsonb,
    p_client_id    text,
    p_is_turn      boolean
) RETURNS TABLE (
    conversation_id uuid,
    seq             bigint,
    id              text,
    type            text,
    sender_id       text,
    sender_role     text,
    data            jsonb,
    metadata        jsonb,
    extra           jsonb,
    client_id       text,
    created_at      timestamptz,
    turn_seq        bigint,
    turn_revision   integer,
    duplicate       boolean
) LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH existing AS (
        SELECT a.conversation_id, a.seq, a.id, a.type, a.sender_id, a.sender_role, a.data,
               a.metadata, a.extra, a.client_id, a.created_at, a.turn_seq, a.turn_revision
          FROM activities a
         WHERE a.conversation_id = p_conversation AND a.sender_id = p_sender_id
           AND a.client_id = p_client_id
    ), conv AS (
        UPDATE conversations c SET last_seq = c.last_seq + 1, updated_at = now()
         WHERE c.id = p_conversation AND c.status = 'open'
           AND NOT EXISTS (SELECT 1 FROM existing)
        RETURNING c.id, c.last_seq, c.channel_id
    ), act AS (
        INSERT INTO activities AS a
            (conversation_id, seq, id, type, sender_id, sender_role, data, metadata, extra,
             client_id, created_at)
        SELECT conv.id, conv.last_seq, p_id, p_kind, p_sender_id, p_sender_role, p_data,
               p_metadata, p_extra, p_client_id, clock_timestamp()
          FROM conv
        RETURNING a.conversation_id, a.seq, a.id, a.type, a.sender_id, a.sender_role, a.data,
                  a.metadata, a.extra, a.client_id, a.created_at, a.turn_seq, a.turn_revision
    ), turn AS (
        INSERT INTO turns (conversation_id, seq, revision, status, created_at)
        SELECT act.conversation_id, act.seq, 0, 'pending', act.created_at FROM act WHERE p_is_turn
    ), event AS (
        INSERT INTO outbox AS o (conversation_id, seq_from, seq_to)
        SELECT act.conversation_id, act.seq, act.seq FROM act
        RETURNING o.id, o.conversation_id, o.seq_from
    ), notified AS (
        SELECT pg_notify('converger_events',
                   json_build_object('k', 'c', 'e', event.id, 'c', event.conversation_id,
                                     's', event.seq_from, 'h', conv.channel_id)::text) AS done
          FROM event, conv
    )
    SELECT act.*, false FROM act WHERE (SELECT count(*) FROM notified) = 1
    UNION ALL
    SELECT existing.*, true FROM existing;
END
$$;

-- converger_commit_batch: the writes of one batch, in the order given (the store sorts them by
-- conversation, so batches lock conversations in one order). Each write is an object:
--   {"kind": "frame", "conversation", "id", "type", "sender_id", "sender_role", "data",
--    "metadata"?, "extra"?, "client_id"?, "is_turn"}
--   {"kind": "answer", "conversation", "seq", "revision", "fence"?, "fingerprint", "sender_id",
--    "sender_role", "has_runtime", "runtime_version", "runtime_state"?,
--    "frames": [{"id", "type", "data", "metadata"?, "extra"?}]}
-- It returns one element per write, in order: converger_commit_frame's row as an object (null
-- when the conversation is missing or closed), or converger_answer_turn's OUT parameters as an
-- object. Any error aborts the whole statement, and the store then runs each write alone.
CREATE FUNCTION converger_commit_batch(p_writes jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    write   jsonb;
    outcome jsonb;
    outcomes jsonb[] := '{}';
BEGIN
    FOR write IN SELECT w.value FROM jsonb_array_elements(p_writes) WITH ORDINALITY AS w
                 ORDER BY w.ordinality
    LOOP
        IF write->>'kind' = 'frame' THEN
            SELECT to_jsonb(f) INTO outcome
              FROM converger_commit_frame(
                       (write->>'conversation')::uuid, write->>'id', write->>'type',
                       write->>'sender_id', write->>'sender_role', write->'data',
                       write->'metadata', write->'extra', write->>'client_id',
                       (write->>'is_turn')::boolean) AS f;
        ELSIF write->>'kind' = 'answer' THEN
            SELECT to_jsonb(r) INTO outcome
              FROM converger_answer_turn(
                       (write->>'conversation')::uuid, (write->>'seq')::bigint,
                       (write->>'revision')::integer, (write->>'fence')::bigint,
                       write->>'fingerprint', write->>'sender_id', write->>'sender_role',
                       (write->>'has_runtime')::boolean, (write->>'runtime_version')::bigint,
                       write->'runtime_state',
                       ARRAY(SELECT e.value->>'id' FROM jsonb_array_elements(write->'frames')
                             WITH ORDINALITY AS e ORDER BY e.ordinality),
                       ARRAY(SELECT e.value->>'type' FROM jsonb_array_elements(write->'frames')
                             WITH ORDINALITY AS e ORDER BY e.ordinality),
                       ARRAY(SELECT e.value->'data' FROM jsonb_array_elements(write->'frames')
                             WITH ORDINALITY AS e ORDER BY e.ordinality),
                       ARRAY(SELECT e.value->'metadata' FROM jsonb_array_elements(write->'frames')
                             WITH ORDINALITY AS e ORDER BY e.ordinality),
                       ARRAY(SELECT e.value->'extra' FROM jsonb_array_elements(write->'frames')
                             WITH ORDINALITY AS e ORDER BY e.ordinality)) AS r;
        ELSE
            RAISE EXCEPTION 'converger_commit_batch: unknown write kind %', write->>'kind';
        END IF;
        outcomes := outcomes || coalesce(outcome, 'null'::jsonb);
        outcome := NULL;
    END LOOP;
    RETURN to_jsonb(outcomes);
END
$$;
