-- A batch's notifications name the node that committed it ("n", from the transaction's
-- converger.node setting, which the group-commit worker sets in the batch's own statement).
-- That node has already handed the batch to its sessions and agents, so it skips the echo
-- without decoding it (ADR 0021). Without the setting (other clients, older nodes) the
-- notification is as before and every node decodes it.
CREATE OR REPLACE FUNCTION converger_notify_committed(p_event bigint, p_events jsonb[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    node    text := coalesce(current_setting('converger.node', true), '');
    prefix  text;
    pending text := '';
    piece   text;
    event   jsonb;
BEGIN
    prefix := '{"k":"cb",'
        || CASE WHEN node = '' THEN '' ELSE '"n":' || to_jsonb(node)::text || ',' END
        || '"e":' || p_event || ',"v":[';
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
