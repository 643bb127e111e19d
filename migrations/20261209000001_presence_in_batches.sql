-- Presence changes in batches (ADR 0043): a node hands the changes of every session that
-- opened or closed meanwhile to one call, so a thousand sockets closing at once cost a few
-- round trips instead of six each. Each change keeps its own total, as if made alone: the
-- changes are applied in the order given, each under its (conversation, participant) lock.
CREATE FUNCTION converger_change_presence(
    conversations   uuid[],
    participants    text[],
    joined          boolean[],
    node            text,
    node_generation bigint
) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    pair   record;
    totals bigint[] := '{}';
    total  bigint;
BEGIN
    -- Every pair's lock first, in the order the reaper takes them (conversation, participant),
    -- so two batches, or a batch and a reaper, never wait on each other in a cycle.
    FOR pair IN
        SELECT DISTINCT k.c, k.p FROM unnest(conversations, participants) AS k(c, p)
        ORDER BY k.c, k.p
    LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(pair.c::text || '/' || pair.p, 0));
    END LOOP;
    FOR i IN 1 .. coalesce(array_length(conversations, 1), 0) LOOP
        IF joined[i] THEN
            INSERT INTO presence_connections AS p
                (conversation_id, participant_id, node_id, generation, connections)
            VALUES (conversations[i], participants[i], node, node_generation, 1)
            ON CONFLICT (conversation_id, participant_id, node_id, generation)
            DO UPDATE SET connections = p.connections + 1;
        ELSE
            -- `node_id || ''` keeps the planner off `presence_by_node`: without statistics
            -- (a new table) the cached generic plan took that index and read every row of
            -- the node for each count out. The pair's own rows are a few at most.
            UPDATE presence_connections SET connections = connections - 1
            WHERE conversation_id = conversations[i] AND participant_id = participants[i]
              AND node_id || '' = node AND generation = node_generation;
            DELETE FROM presence_connections
            WHERE conversation_id = conversations[i] AND participant_id = participants[i]
              AND connections <= 0;
        END IF;
        -- Each statement here sees what committed before it, and the locks keep every other
        -- change of these pairs out, so the sum is the cluster's after this change.
        SELECT coalesce(sum(connections), 0) INTO total FROM presence_connections
        WHERE conversation_id = conversations[i] AND participant_id = participants[i];
        totals := totals || total;
    END LOOP;
    RETURN totals;
END
$$;
