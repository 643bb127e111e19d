-- An agent's answer to a turn in one round trip (it used to take six statements, each a round
-- trip while the turn's and the conversation's row locks were held). The caller runs it inside
-- its transaction and commits; outcomes other than 'committed' write nothing.
--
-- o_outcome: committed | duplicate | conflict | superseded | lease_lost | stale_runtime |
-- no_such_turn. o_number carries the latest revision (superseded), the current fence
-- (lease_lost) or the current runtime version (stale_runtime). The NOTIFY channel name is the
-- store's NOTIFY_CHANNEL.
CREATE FUNCTION converger_answer_turn(
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
            RETURNING activities.seq, activities.id, activities.created_at
        )
        SELECT array_agg(inserted.id ORDER BY inserted.seq),
               array_agg(inserted.seq ORDER BY inserted.seq),
               array_agg(inserted.created_at ORDER BY inserted.seq)
          INTO o_ids, o_seqs, o_created
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
            json_build_object('k', 'c', 'e', event_id, 'c', p_conversation,
                              's', o_seqs[frame_count], 'h', channel)::text);
    END IF;
    o_outcome := 'committed';
END
$$;
