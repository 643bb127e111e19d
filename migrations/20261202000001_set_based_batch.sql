-- Set-based group commit (ADR 0020). converger_commit_batch keeps its argument and its result,
-- but no longer runs one function per frame: the batch's frames are one statement over the whole
-- set (duplicates found with one join, one UPDATE of the conversations' heads, one INSERT of the
-- activities, one INSERT of the turns), and the whole batch writes one outbox row and as few
-- notifications as fit its frames (each under Postgres's 8,000-byte limit), instead of one outbox
-- row and one notification per write.

-- A batch's outbox row names every conversation it committed and the highest seq of each, in
-- two parallel arrays, and how many frames it stored; single-event rows keep seq_from/seq_to.
ALTER TABLE outbox ADD COLUMN conversations uuid[];
ALTER TABLE outbox ADD COLUMN last_seqs bigint[];
ALTER TABLE outbox ADD COLUMN frames integer;

-- Only the takeover lookups of a node starting to serve a channel and the status page's count
-- read pending turns by time; the per-conversation look-ups use the primary key's prefix. One
-- partial index on pending rows is enough, and every turn writes one index entry fewer.
DROP INDEX turns_pending;

-- converger_batch_answer: converger_answer_turn without its outbox row and notification, which
-- the batch writes once for all its writes. o_frames carries the stored frames, o_channel the
-- conversation's channel, for that notification.
CREATE FUNCTION converger_batch_answer(
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
    OUT o_completed   timestamptz,
    OUT o_frames      jsonb,
    OUT o_channel     uuid
) LANGUAGE plpgsql AS $$
DECLARE
    latest          record;
    current_version bigint;
    frame_count     integer := coalesce(array_length(p_ids, 1), 0);
    head            bigint;
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
        RETURNING c.last_seq, c.channel_id INTO head, o_channel;
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
          INTO o_ids, o_seqs, o_created, o_frames
          FROM inserted;
    END IF;
    UPDATE turns t
       SET status = 'completed', result_fingerprint = p_fingerprint, result_ids = o_ids,
           result_seqs = o_seqs, completed_at = now()
     WHERE t.conversation_id = p_conversation AND t.seq = p_seq AND t.revision = p_revision
    RETURNING t.completed_at INTO o_completed;
    o_outcome := 'committed';
END
$$;

-- converger_notify_committed: the batch's notifications. Each event ({"c", "a", "s", "h", "f"}:
-- the conversation, its first and last seq, its channel and the stored frames) joins the current
-- notification while that stays under 7,500 bytes; an event too large on its own travels without
-- its frames, which receivers then read back. Every notification names the batch's outbox row.
CREATE FUNCTION converger_notify_committed(p_event bigint, p_events jsonb[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    prefix  text := '{"k":"cb","e":' || p_event || ',"v":[';
    pending text := '';
    piece   text;
    event   jsonb;
BEGIN
    FOREACH event IN ARRAY p_events LOOP
        piece := event::text;
        IF octet_length(prefix) + octet_length(piece) + 2 >= 7500 THEN
            piece := (event - 'f')::text;
        END IF;
        IF pending <> '' AND octet_length(prefix) + octet_length(pending)
                             + octet_length(piece) + 3 >= 7500 THEN
            PERFORM pg_notify('converger_events', prefix || pending || ']}');
            pending := '';
        END IF;
        IF pending = '' THEN
            pending := piece;
        ELSE
            pending := pending || ',' || piece;
        END IF;
    END LOOP;
    IF pending <> '' THEN
        PERFORM pg_notify('converger_events', prefix || pending || ']}');
    END IF;
END
$$;

-- converger_commit_batch: same argument and result as before (migration 20261130000005).
-- 1. Every conversation of the batch is locked, in id order, in one statement: batches never
--    deadlock on each other, and what follows sees every write committed before the lock.
-- 2. The frames, as one statement: a repeated idempotency key (stored before, or earlier in the
--    same batch) answers with the first frame and duplicate = true; a missing or closed
--    conversation answers null; the rest get consecutive seqs per conversation, in batch order,
--    and one created_at, read after the locks are held (so it never goes backwards as seq grows).
-- 3. The answers, each a call of converger_batch_answer, after the frames.
-- 4. One outbox row and the notifications for everything stored.
CREATE OR REPLACE FUNCTION converger_commit_batch(p_writes jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    outcomes       jsonb[];
    frame_outcomes jsonb;
    events         jsonb[];
    answer_events  jsonb[] := '{}';
    write          record;
    answer         record;
    frame_ids      text[];
    frame_kinds    text[];
    frame_data     jsonb[];
    frame_metadata jsonb[];
    frame_extra    jsonb[];
    event_id       bigint;
    stored         integer;
    committed_at   timestamptz;
    conversation_ids uuid[];
    earlier_rows   jsonb;
BEGIN
    outcomes := array_fill('null'::jsonb, ARRAY[jsonb_array_length(p_writes)]);

    -- Every look-up below names its keys (an array, or one row's values): a plan cached while
    -- the tables were small must still read only those keys once they are large.
    SELECT array_agg(DISTINCT (w.value->>'conversation')::uuid) INTO conversation_ids
      FROM jsonb_array_elements(p_writes) AS w;
    PERFORM 1 FROM conversations c
      WHERE c.id = ANY(conversation_ids)
      ORDER BY c.id
        FOR NO KEY UPDATE;
    -- Read once the locks are held: a conversation's next batch reads a later time.
    committed_at := clock_timestamp();

    -- The frames' idempotency keys stored before, planned afresh for every batch (EXECUTE): the
    -- activities table has three indexes led by conversation_id, and a plan cached while it was
    -- small may pick one that reads every activity of the conversation instead of the key's.
    EXECUTE 'SELECT coalesce(jsonb_agg(jsonb_build_object(''ord'', k.ord) || to_jsonb(a)), ''[]'')
               FROM jsonb_array_elements($1) WITH ORDINALITY AS k(w, ord)
              CROSS JOIN LATERAL (
                    SELECT * FROM activities a
                     WHERE a.conversation_id = (k.w->>''conversation'')::uuid
                       AND a.sender_id = k.w->>''sender_id''
                       AND a.client_id = k.w->>''client_id'' AND a.client_id IS NOT NULL
                     LIMIT 1) AS a
              WHERE k.w->>''kind'' = ''frame'' AND k.w->>''client_id'' IS NOT NULL'
       INTO earlier_rows USING p_writes;

    WITH given AS (
        SELECT w.ordinality::integer AS ord,
               (w.value->>'conversation')::uuid AS conversation_id,
               w.value->>'id' AS id, w.value->>'type' AS type,
               w.value->>'sender_id' AS sender_id, w.value->>'sender_role' AS sender_role,
               w.value->'data' AS data, w.value->'metadata' AS metadata,
               w.value->'extra' AS extra, w.value->>'client_id' AS client_id,
               (w.value->>'is_turn')::boolean AS is_turn
          FROM jsonb_array_elements(p_writes) WITH ORDINALITY AS w
         WHERE w.value->>'kind' = 'frame'
    ), earlier AS (
        SELECT (e.value->>'ord')::integer AS ord, e.value - 'ord' AS stored
          FROM jsonb_array_elements(earlier_rows) AS e
    ), keyed AS (
        -- first_ord: the batch's first write with the same idempotency key (itself when none)
        SELECT given.*,
               CASE WHEN given.client_id IS NULL THEN given.ord
                    ELSE min(given.ord) OVER (PARTITION BY given.conversation_id,
                                                           given.sender_id, given.client_id)
               END AS first_ord
          FROM given
         WHERE NOT EXISTS (SELECT 1 FROM earlier WHERE earlier.ord = given.ord)
    ), fresh AS (
        SELECT keyed.*,
               row_number() OVER (PARTITION BY keyed.conversation_id ORDER BY keyed.ord) AS n
          FROM keyed
         WHERE keyed.first_ord = keyed.ord
    ), heads AS (
        UPDATE conversations c
           SET last_seq = c.last_seq + counts.frames, updated_at = now()
          FROM (SELECT fresh.conversation_id, count(*) AS frames
                  FROM fresh GROUP BY fresh.conversation_id) AS counts
         WHERE c.id = ANY(conversation_ids) AND c.id = counts.conversation_id
           AND c.status = 'open'
        RETURNING c.id, c.last_seq - counts.frames AS base, c.last_seq, c.channel_id
    ), act AS (
        INSERT INTO activities AS a
            (conversation_id, seq, id, type, sender_id, sender_role, data, metadata, extra,
             client_id, created_at)
        SELECT fresh.conversation_id, heads.base + fresh.n, fresh.id, fresh.type,
               fresh.sender_id, fresh.sender_role, fresh.data, fresh.metadata, fresh.extra,
               fresh.client_id, committed_at
          FROM fresh JOIN heads ON heads.id = fresh.conversation_id
        RETURNING a.*
    ), turn AS (
        INSERT INTO turns (conversation_id, seq, revision, status, created_at)
        SELECT act.conversation_id, act.seq, 0, 'pending', act.created_at
          FROM act
          JOIN heads ON heads.id = act.conversation_id
          JOIN fresh ON fresh.conversation_id = act.conversation_id
                    AND fresh.n = act.seq - heads.base
         WHERE fresh.is_turn
    ), stored_frames AS (
        SELECT fresh.ord, act.conversation_id, act.seq, to_jsonb(act) AS frame
          FROM act
          JOIN heads ON heads.id = act.conversation_id
          JOIN fresh ON fresh.conversation_id = act.conversation_id
                    AND fresh.n = act.seq - heads.base
    ), answered AS (
        SELECT stored_frames.ord, stored_frames.frame || '{"duplicate": false}' AS outcome
          FROM stored_frames
        UNION ALL
        SELECT keyed.ord, stored_frames.frame || '{"duplicate": true}'
          FROM keyed JOIN stored_frames ON stored_frames.ord = keyed.first_ord
         WHERE keyed.first_ord <> keyed.ord
        UNION ALL
        SELECT earlier.ord, earlier.stored || '{"duplicate": true}'
          FROM earlier
    ), per_conversation AS MATERIALIZED (
        SELECT stored_frames.conversation_id,
               jsonb_agg(stored_frames.frame ORDER BY stored_frames.seq) AS frames
          FROM stored_frames
         GROUP BY stored_frames.conversation_id
    )
    SELECT (SELECT jsonb_object_agg(answered.ord, answered.outcome) FROM answered),
           (SELECT array_agg(jsonb_build_object('c', heads.id, 'a', heads.base + 1,
                                                's', heads.last_seq, 'h', heads.channel_id,
                                                'f', per_conversation.frames)
                             ORDER BY heads.id)
              FROM heads JOIN per_conversation ON per_conversation.conversation_id = heads.id),
           (SELECT count(*) FROM stored_frames)
      INTO frame_outcomes, events, stored;

    IF frame_outcomes IS NOT NULL THEN
        FOR write IN SELECT key::integer AS ord, value FROM jsonb_each(frame_outcomes) LOOP
            outcomes[write.ord] := write.value;
        END LOOP;
    END IF;

    FOR write IN SELECT w.ordinality::integer AS ord, w.value
                   FROM jsonb_array_elements(p_writes) WITH ORDINALITY AS w
                  WHERE w.value->>'kind' <> 'frame'
                  ORDER BY w.ordinality
    LOOP
        IF write.value->>'kind' <> 'answer' THEN
            RAISE EXCEPTION 'converger_commit_batch: unknown write kind %', write.value->>'kind';
        END IF;
        -- The frames' columns as arrays, in one pass over the frames.
        SELECT coalesce(array_agg(e.value->>'id' ORDER BY e.ordinality), '{}'),
               coalesce(array_agg(e.value->>'type' ORDER BY e.ordinality), '{}'),
               coalesce(array_agg(e.value->'data' ORDER BY e.ordinality), '{}'),
               coalesce(array_agg(e.value->'metadata' ORDER BY e.ordinality), '{}'),
               coalesce(array_agg(e.value->'extra' ORDER BY e.ordinality), '{}')
          INTO frame_ids, frame_kinds, frame_data, frame_metadata, frame_extra
          FROM jsonb_array_elements(write.value->'frames') WITH ORDINALITY AS e;
        SELECT * INTO answer
          FROM converger_batch_answer(
                   (write.value->>'conversation')::uuid, (write.value->>'seq')::bigint,
                   (write.value->>'revision')::integer, (write.value->>'fence')::bigint,
                   write.value->>'fingerprint', write.value->>'sender_id',
                   write.value->>'sender_role', (write.value->>'has_runtime')::boolean,
                   (write.value->>'runtime_version')::bigint, write.value->'runtime_state',
                   frame_ids, frame_kinds, frame_data, frame_metadata, frame_extra);
        outcomes[write.ord] := jsonb_build_object(
            'o_outcome', answer.o_outcome, 'o_number', answer.o_number,
            'o_ids', answer.o_ids, 'o_seqs', answer.o_seqs, 'o_created', answer.o_created,
            'o_completed', answer.o_completed);
        IF answer.o_frames IS NOT NULL THEN
            answer_events := answer_events || jsonb_build_object(
                'c', (write.value->>'conversation')::uuid, 'a', answer.o_seqs[1],
                's', answer.o_seqs[array_length(answer.o_seqs, 1)],
                'h', answer.o_channel, 'f', answer.o_frames);
            stored := stored + array_length(answer.o_seqs, 1);
        END IF;
    END LOOP;

    events := coalesce(events, '{}') || answer_events;
    IF array_length(events, 1) > 0 THEN
        INSERT INTO outbox (conversations, last_seqs, frames)
        SELECT array_agg((e->>'c')::uuid), array_agg((e->>'s')::bigint), stored
          FROM unnest(events) AS e
        RETURNING id INTO event_id;
        PERFORM converger_notify_committed(event_id, events);
    END IF;
    RETURN to_jsonb(outcomes);
END
$$;

-- Plans must not depend on statistics: plpgsql caches its plans per backend, and a plan made
-- while a table was small (a sequential scan, cheapest then) would stay after the table grew,
-- until the next ANALYZE. Every look-up in the batch has an index, so the batch never scans.
ALTER FUNCTION converger_commit_batch(jsonb) SET enable_seqscan = off;

DROP FUNCTION converger_commit_frame(uuid, text, text, text, text, jsonb, jsonb, jsonb, text, boolean);
DROP FUNCTION converger_answer_turn(uuid, bigint, integer, bigint, text, text, text, boolean,
                                    bigint, jsonb, text[], text[], jsonb[], jsonb[], jsonb[]);
DROP FUNCTION converger_committed_payload(bigint, uuid, bigint, uuid, jsonb);

ANALYZE conversations;
ANALYZE activities;
ANALYZE turns;
ANALYZE outbox;
