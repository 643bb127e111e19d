-- A group-commit batch in one round trip (ADR 0011). It used to be BEGIN, one statement per
-- write, then COMMIT: per write, a round trip and a statement start on both sides.
--
-- converger_commit_frame: one frame, as the statement in crates/store/src/activities.rs used to
-- do it. It allocates the seq under the conversation row lock, inserts the activity, the turn
-- row for user frames and the outbox row, and notifies. No row when the conversation is missing
-- or closed; the original row with duplicate = true when the idempotency key was used before.
-- The timestamp is read after the row lock is held, so within a conversation it never goes
-- backwards as seq grows.
-- converger_committed_payload: the notification of a commit. It carries the committed frames
-- themselves when the whole payload stays under 7,500 bytes, so no node has to read them back;
-- Postgres refuses payloads of 8,000 bytes and more, so larger frames are left out and
-- receivers read them.
-- plpgsql rather than SQL: an SQL function is inlined, so its text would be parsed again each
-- time Postgres plans the calling statement.
CREATE FUNCTION converger_committed_payload(
    p_event        bigint,
    p_conversation uuid,
    p_seq          bigint,
    p_channel      uuid,
    p_frames       jsonb
) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    payload text;
BEGIN
    IF p_frames IS NOT NULL THEN
        payload := json_build_object('k', 'c', 'e', p_event, 'c', p_conversation, 's', p_seq,
                                     'h', p_channel, 'f', p_frames)::text;
        IF octet_length(payload) < 7500 THEN
            RETURN payload;
        END IF;
    END IF;
    RETURN json_build_object('k', 'c', 'e', p_event, 'c', p_conversation, 's', p_seq,
                             'h', p_channel)::text;
END
$$;

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
                   converger_committed_payload(event.id, event.conversation_id, event.seq_from,
                                               conv.channel_id,
                                               (SELECT jsonb_agg(to_jsonb(act)) FROM act))) AS done
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
    write          jsonb;
    outcome        jsonb;
    outcomes       jsonb[] := '{}';
    frame_ids      text[];
    frame_kinds    text[];
    frame_data     jsonb[];
    frame_metadata jsonb[];
    frame_extra    jsonb[];
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
            -- The frames' columns as arrays, in one pass over the frames.
            SELECT coalesce(array_agg(e.value->>'id' ORDER BY e.ordinality), '{}'),
                   coalesce(array_agg(e.value->>'type' ORDER BY e.ordinality), '{}'),
                   coalesce(array_agg(e.value->'data' ORDER BY e.ordinality), '{}'),
                   coalesce(array_agg(e.value->'metadata' ORDER BY e.ordinality), '{}'),
                   coalesce(array_agg(e.value->'extra' ORDER BY e.ordinality), '{}')
              INTO frame_ids, frame_kinds, frame_data, frame_metadata, frame_extra
              FROM jsonb_array_elements(write->'frames') WITH ORDINALITY AS e;
            SELECT to_jsonb(r) INTO outcome
              FROM converger_answer_turn(
                       (write->>'conversation')::uuid, (write->>'seq')::bigint,
                       (write->>'revision')::integer, (write->>'fence')::bigint,
                       write->>'fingerprint', write->>'sender_id', write->>'sender_role',
                       (write->>'has_runtime')::boolean, (write->>'runtime_version')::bigint,
                       write->'runtime_state', frame_ids, frame_kinds, frame_data,
                       frame_metadata, frame_extra) AS r;
        ELSE
            RAISE EXCEPTION 'converger_commit_batch: unknown write kind %', write->>'kind';
        END IF;
        outcomes := outcomes || coalesce(outcome, 'null'::jsonb);
        outcome := NULL;
    END LOOP;
    RETURN to_jsonb(outcomes);
END
$$;

-- converger_answer_turn (migration 20261130000003), unchanged but for its notification, which
-- now carries the stored frames (converger_committed_payload).
CREATE OR REPLACE FUNCTION converger_answer_turn(
    p_conversation    uuid,
    p_seq             bigint,
    p_revision        integer,
    p_fence           bigint,
    p_fingerprint     text,
    p_sender_id       text,
    p_sender_role     text,
    p_has_runtime     boolean,
    p_runtime_version bigint,
    p_runtime_state   jsonb,
    p_ids             text[],
    p_kinds           text[],
    p_data            jsonb[],
    p_metadata        jsonb[],
    p_extra           jsonb[],
    OUT o_outcome     text,
    OUT o_number      bigint,
    OUT o_ids         text[],
    OUT o_seqs        bigint[],
    OUT o_created     timestamptz[],
    OUT o_completed   timestamptz
) LANGUAGE plpgsql AS $$
DECLARE
    latest          record;
    current_version bigint;
    frame_count     integer := coalesce(array_length(p_ids, 1), 0);
    head            bigint;
    channel         uuid;
    event_id        bigint;
    stored_frames   jsonb;
BEGIN
    -- The latest revision's row, locked: concurrent answers to one turn queue here.
    SELECT t.revision, t.status, t.result_fingerprint, t.result_ids, t.result_seqs,
           t.completed_at, t.fence
      INTO latest
      FROM turns t
     WHERE t.conversation_id = p_conversation AND t.seq = p_seq
     ORDER BY t.revision DESC
     LIMIT 1
       FOR UPDATE;
    IF NOT FOUND OR p_revision > latest.revision THEN
        o_outcome := 'no_such_turn';
        RETURN;
    END IF;
    IF p_revision < latest.revision THEN
        o_outcome := 'superseded';
        o_number := latest.revision;
        RETURN;
    END IF;
    IF latest.status = 'completed' AND latest.result_fingerprint = p_fingerprint THEN
        o_outcome := 'duplicate';
        o_ids := coalesce(latest.result_ids, '{}');
        o_seqs := coalesce(latest.result_seqs, '{}');
        o_completed := coalesce(latest.completed_at, now());
        RETURN;
    END IF;
    -- Lease mode: a delivery older than the latest claim no longer holds the turn.
    IF p_fence IS NOT NULL AND p_fence <> latest.fence THEN
        o_outcome := 'lease_lost';
        o_number := latest.fence;
        RETURN;
    END IF;
    IF latest.status = 'completed' THEN
        o_outcome := 'conflict';
        o_seqs := coalesce(latest.result_seqs, '{}');
        RETURN;
    END IF;
    IF p_has_runtime THEN
        SELECT r.version INTO current_version
          FROM conversation_runtime r
         WHERE r.conversation_id = p_conversation
           FOR UPDATE;
        current_version := coalesce(current_version, 0);
        IF current_version <> p_runtime_version THEN
            o_outcome := 'stale_runtime';
            o_number := current_version;
            RETURN;
        END IF;
        INSERT INTO conversation_runtime (conversation_id, version, state)
        VALUES (p_conversation, 1, p_runtime_state)
        ON CONFLICT (conversation_id) DO UPDATE
           SET version = conversation_runtime.version + 1,
               state = EXCLUDED.state,
               updated_at = now();
    END IF;
    o_ids := '{}';
    o_seqs := '{}';
    o_created := '{}';
    IF frame_count > 0 THEN
        UPDATE conversations c
           SET last_seq = c.last_seq + frame_count, updated_at = now()
         WHERE c.id = p_conversation
        RETURNING c.last_seq, c.channel_id INTO head, channel;
        WITH inserted AS (
            INSERT INTO activities
                (conversation_id, seq, id, type, sender_id, sender_role, data, metadata, extra,
                 turn_seq, turn_revision, created_at)
            SELECT p_conversation, head - frame_count + frame.ordinality, frame.id, frame.kind,
                   p_sender_id, p_sender_role, frame.data, frame.metadata, frame.extra,
                   p_seq, p_revision, clock_timestamp()
              FROM unnest(p_ids, p_kinds, p_data, p_metadata, p_extra)
                   WITH ORDINALITY AS frame(id, kind, data, metadata, extra, ordinality)
            RETURNING activities.*
        )
        SELECT array_agg(inserted.id ORDER BY inserted.seq),
               array_agg(inserted.seq ORDER BY inserted.seq),
               array_agg(inserted.created_at ORDER BY inserted.seq),
               jsonb_agg(to_jsonb(inserted) ORDER BY inserted.seq)
          INTO o_ids, o_seqs, o_created, stored_frames
          FROM inserted;
    END IF;
    UPDATE turns t
       SET status = 'completed', result_fingerprint = p_fingerprint, result_ids = o_ids,
           result_seqs = o_seqs, completed_at = now()
     WHERE t.conversation_id = p_conversation AND t.seq = p_seq AND t.revision = p_revision
    RETURNING t.completed_at INTO o_completed;
    IF frame_count > 0 THEN
        INSERT INTO outbox (conversation_id, seq_from, seq_to)
        VALUES (p_conversation, o_seqs[1], o_seqs[frame_count])
        RETURNING id INTO event_id;
        PERFORM pg_notify('converger_events',
            converger_committed_payload(event_id, p_conversation, o_seqs[frame_count], channel,
                                        stored_frames));
    END IF;
    o_outcome := 'committed';
END
$$;
