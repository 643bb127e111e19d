-- Which bus announces commits (ADR 0033). With the `pg_notify` bus, the committing statement
-- notifies as before. With another bus (NATS, or one node alone), the node sets
-- `converger.notify = off` on every connection it opens, the statements keep writing their
-- outbox rows (the log a catch-up reads) but send no notification, and the node publishes each
-- commit itself once the transaction committed: no notifying commit takes Postgres's
-- server-wide notify lock.

-- A notification on the events channel, unless this session's bus announces commits itself.
CREATE FUNCTION converger_notify(p_payload text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('converger.notify', true), '') = 'off' THEN
        RETURN;
    END IF;
    PERFORM pg_notify('converger_events', p_payload);
END
$$;

CREATE OR REPLACE FUNCTION converger_notify_committed(p_event bigint, p_events jsonb[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    node    text := coalesce(current_setting('converger.node', true), '');
    prefix  text;
    pending text := '';
    piece   text;
    event   jsonb;
BEGIN
    IF coalesce(current_setting('converger.notify', true), '') = 'off' THEN
        RETURN;
    END IF;
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
