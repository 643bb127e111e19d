-- Stopped turns (ADR 0028). A stop marks the turn's latest revision `stopping` (with the reason
-- and the time, under the conversation's row lock): no longer pending, so no takeover, lease
-- claim or redelivery hands it on, while the agent's own answer is still taken. After the grace
-- period the gateway settles a turn still `stopping` as `stopped`, committing what was streamed;
-- an answer to a `stopped` turn is refused with the outcome `stopped`, in the batch's set and in
-- the one-by-one call alike. Both functions are as in migration 20261203000001 but for that one
-- check.

ALTER TABLE turns ADD COLUMN stop_reason text;
ALTER TABLE turns ADD COLUMN stop_requested_at timestamptz;
-- The sweep that settles stops whose node died before their grace ran out.
CREATE INDEX turns_stopping ON turns (stop_requested_at) WHERE status = 'stopping';

CREATE OR REPLACE FUNCTION converger_batch_answer(
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
    -- A turn of a conversation that was closed while it waited: settled as closed.
    IF latest.status = 'closed' THEN
        o_outcome := 'closed';
        RETURN;
    END IF;
    -- A turn the gateway settled after a stop.
    IF latest.status = 'stopped' THEN
        o_outcome := 'stopped';
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
    answer_outcomes jsonb;
    settled        jsonb;
    answer_stored  integer;
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

    -- The answers. The first answer of each conversation runs with the others as one set: they
    -- touch different conversations (their turns, runtimes and heads), so the set decides what
    -- running them one by one would. A later answer of a conversation already answered in this
    -- batch (rare: a resend racing its first send) runs after the set, one call each, in batch
    -- order, and sees what the set wrote.
    -- Every look-up is by a whole key: the latest revision of a turn and a runtime by LATERAL
    -- probes (each the primary key), the heads by id = ANY, so no cached plan reads a
    -- conversation's history. The turns' status updates, one per committed answer, follow as
    -- single-row statements below, for the same reason.
    WITH given AS (
        SELECT w.ordinality::integer AS ord,
               (w.value->>'conversation')::uuid AS conversation_id,
               (w.value->>'seq')::bigint AS seq, (w.value->>'revision')::integer AS revision,
               (w.value->>'fence')::bigint AS fence, w.value->>'fingerprint' AS fingerprint,
               w.value->>'sender_id' AS sender_id, w.value->>'sender_role' AS sender_role,
               (w.value->>'has_runtime')::boolean AS has_runtime,
               (w.value->>'runtime_version')::bigint AS runtime_version,
               w.value->'runtime_state' AS runtime_state,
               coalesce(w.value->'frames', '[]') AS frames,
               row_number() OVER (PARTITION BY (w.value->>'conversation')::uuid
                                  ORDER BY w.ordinality) AS nth
          FROM jsonb_array_elements(p_writes) WITH ORDINALITY AS w
         WHERE w.value->>'kind' = 'answer'
    ), firsts AS (
        SELECT given.* FROM given WHERE given.nth = 1
    ), decided AS (
        SELECT firsts.*, latest.found, latest.latest_revision, latest.status,
               latest.result_ids, latest.result_seqs, latest.completed_at,
               latest.latest_fence, coalesce(runtime.version, 0) AS current_version,
               CASE
                   WHEN latest.found IS NULL OR firsts.revision > latest.latest_revision
                       THEN 'no_such_turn'
                   WHEN firsts.revision < latest.latest_revision THEN 'superseded'
                   WHEN latest.status = 'completed'
                        AND latest.result_fingerprint = firsts.fingerprint THEN 'duplicate'
                   -- A turn of a conversation closed while it waited is settled as closed.
                   WHEN latest.status = 'closed' THEN 'closed'
                   -- A turn the gateway settled after a stop.
                   WHEN latest.status = 'stopped' THEN 'stopped'
                   -- Lease mode: a delivery older than the latest claim no longer holds it.
                   WHEN firsts.fence IS NOT NULL AND firsts.fence <> latest.latest_fence
                       THEN 'lease_lost'
                   WHEN latest.status = 'completed' THEN 'conflict'
                   WHEN firsts.has_runtime
                        AND coalesce(runtime.version, 0) <> firsts.runtime_version
                       THEN 'stale_runtime'
                   ELSE 'committed'
               END AS outcome
          FROM firsts
          -- The latest revision's row, locked: concurrent answers to one turn queue here.
          LEFT JOIN LATERAL (
                SELECT true AS found, t.revision AS latest_revision, t.status,
                       t.result_fingerprint, t.result_ids, t.result_seqs, t.completed_at,
                       t.fence AS latest_fence
                  FROM turns t
                 WHERE t.conversation_id = firsts.conversation_id AND t.seq = firsts.seq
                 ORDER BY t.revision DESC
                 LIMIT 1
                   FOR UPDATE) AS latest ON true
          LEFT JOIN LATERAL (
                SELECT r.version
                  FROM conversation_runtime r
                 WHERE firsts.has_runtime AND r.conversation_id = firsts.conversation_id
                   FOR UPDATE) AS runtime ON true
    ), committing AS (
        SELECT decided.* FROM decided WHERE decided.outcome = 'committed'
    ), runtimes AS (
        INSERT INTO conversation_runtime (conversation_id, version, state)
        SELECT committing.conversation_id, 1, committing.runtime_state
          FROM committing
         WHERE committing.has_runtime
        ON CONFLICT (conversation_id) DO UPDATE
           SET version = conversation_runtime.version + 1,
               state = EXCLUDED.state,
               updated_at = now()
    ), counted AS (
        SELECT committing.conversation_id, jsonb_array_length(committing.frames) AS frames
          FROM committing
         WHERE jsonb_array_length(committing.frames) > 0
    ), heads AS (
        UPDATE conversations c
           SET last_seq = c.last_seq + counted.frames, updated_at = now()
          FROM counted
         WHERE c.id = ANY(conversation_ids) AND c.id = counted.conversation_id
        RETURNING c.id, c.last_seq - counted.frames AS base, c.channel_id
    ), act AS (
        INSERT INTO activities AS a
            (conversation_id, seq, id, type, sender_id, sender_role, data, metadata, extra,
             turn_seq, turn_revision, created_at)
        SELECT committing.conversation_id, heads.base + frame.ordinality, frame.value->>'id',
               frame.value->>'type', committing.sender_id, committing.sender_role,
               frame.value->'data', frame.value->'metadata', frame.value->'extra',
               committing.seq, committing.revision, clock_timestamp()
          FROM committing
          JOIN heads ON heads.id = committing.conversation_id
         CROSS JOIN LATERAL jsonb_array_elements(committing.frames)
                    WITH ORDINALITY AS frame(value, ordinality)
        RETURNING a.*
    ), answer_frames AS (
        -- One answer per conversation in the set: its frames are its conversation's.
        SELECT act.conversation_id,
               array_agg(act.id ORDER BY act.seq) AS ids,
               array_agg(act.seq ORDER BY act.seq) AS seqs,
               array_agg(act.created_at ORDER BY act.seq) AS created,
               jsonb_agg(to_jsonb(act) ORDER BY act.seq) AS frames
          FROM act
         GROUP BY act.conversation_id
    ), answered AS (
        SELECT decided.ord, decided.outcome, decided.conversation_id, decided.seq,
               decided.revision, decided.fingerprint,
               CASE decided.outcome
                   WHEN 'superseded' THEN decided.latest_revision::bigint
                   WHEN 'lease_lost' THEN decided.latest_fence
                   WHEN 'stale_runtime' THEN decided.current_version
               END AS number,
               CASE decided.outcome
                   WHEN 'duplicate' THEN coalesce(decided.result_ids, '{}')
                   WHEN 'committed' THEN coalesce(answer_frames.ids, '{}')
               END AS ids,
               CASE decided.outcome
                   WHEN 'duplicate' THEN coalesce(decided.result_seqs, '{}')
                   WHEN 'conflict' THEN coalesce(decided.result_seqs, '{}')
                   WHEN 'committed' THEN coalesce(answer_frames.seqs, '{}')
               END AS seqs,
               CASE decided.outcome
                   WHEN 'committed' THEN coalesce(answer_frames.created, '{}')
               END AS created,
               CASE decided.outcome
                   WHEN 'duplicate' THEN coalesce(decided.completed_at, now())
                   WHEN 'committed' THEN now()
               END AS completed,
               answer_frames.frames, heads.channel_id
          FROM decided
          LEFT JOIN answer_frames ON answer_frames.conversation_id = decided.conversation_id
                          AND decided.outcome = 'committed'
          LEFT JOIN heads ON heads.id = decided.conversation_id
    )
    SELECT jsonb_object_agg(answered.ord, jsonb_build_object(
               'o_outcome', answered.outcome, 'o_number', answered.number,
               'o_ids', answered.ids, 'o_seqs', answered.seqs, 'o_created', answered.created,
               'o_completed', answered.completed)),
           coalesce(jsonb_agg(jsonb_build_object(
               'conversation', answered.conversation_id, 'seq', answered.seq,
               'revision', answered.revision, 'fingerprint', answered.fingerprint,
               'ids', answered.ids, 'seqs', answered.seqs))
             FILTER (WHERE answered.outcome = 'committed'), '[]'),
           coalesce(array_agg(jsonb_build_object(
               'c', answered.conversation_id, 'a', answered.seqs[1],
               's', answered.seqs[array_length(answered.seqs, 1)],
               'h', answered.channel_id, 'f', answered.frames) ORDER BY answered.ord)
             FILTER (WHERE answered.frames IS NOT NULL), '{}'),
           coalesce(sum(array_length(answered.seqs, 1))
             FILTER (WHERE answered.frames IS NOT NULL), 0)
      INTO answer_outcomes, settled, answer_events, answer_stored
      FROM answered;

    IF answer_outcomes IS NOT NULL THEN
        FOR write IN SELECT key::integer AS ord, value FROM jsonb_each(answer_outcomes) LOOP
            outcomes[write.ord] := write.value;
        END LOOP;
    END IF;
    stored := coalesce(stored, 0) + answer_stored;

    -- The committed turns' status, one row each (whole-key updates, see above). completed_at is
    -- the transaction's time, as the outcomes report it.
    FOR answer IN SELECT (s->>'conversation')::uuid AS conversation_id, (s->>'seq')::bigint AS seq,
                         (s->>'revision')::integer AS revision, s->>'fingerprint' AS fingerprint,
                         ARRAY(SELECT jsonb_array_elements_text(s->'ids')) AS ids,
                         ARRAY(SELECT jsonb_array_elements_text(s->'seqs')::bigint) AS seqs
                    FROM jsonb_array_elements(settled) AS s
    LOOP
        UPDATE turns t
           SET status = 'completed', result_fingerprint = answer.fingerprint,
               result_ids = answer.ids, result_seqs = answer.seqs, completed_at = now()
         WHERE t.conversation_id = answer.conversation_id AND t.seq = answer.seq
           AND t.revision = answer.revision;
    END LOOP;

    -- Later answers of a conversation answered above, one call each, in batch order.
    FOR write IN SELECT w.ordinality::integer AS ord, w.value
                   FROM jsonb_array_elements(p_writes) WITH ORDINALITY AS w
                  WHERE w.value->>'kind' <> 'frame'
                  ORDER BY w.ordinality
    LOOP
        IF write.value->>'kind' <> 'answer' THEN
            RAISE EXCEPTION 'converger_commit_batch: unknown write kind %', write.value->>'kind';
        END IF;
        CONTINUE WHEN outcomes[write.ord] <> 'null'::jsonb;
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

-- As before: every look-up has an index, so the batch never scans a table.
ALTER FUNCTION converger_commit_batch(jsonb) SET enable_seqscan = off;
