-- converger_commit_batch_isolated: the writes of a batch that converger_commit_batch could not
-- commit as a whole, each in a subtransaction of its own (BEGIN ... EXCEPTION), so that a write
-- the database refuses returns its error while the others still commit together, in one
-- statement and one WAL flush: one refused write costs its batch one more statement, not one
-- statement per write.
--
-- Only the fallback: each subtransaction that writes takes an XID of its own, and a transaction
-- with more than 64 of them overflows every backend's snapshot subxid cache, which is why the
-- fast path has none. A refused write's element is {"failed": {"sqlstate", "message"}}; the
-- pg_notify of a rolled-back subtransaction is discarded with it.
CREATE FUNCTION converger_commit_batch_isolated(p_writes jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    write    jsonb;
    outcomes jsonb[] := '{}';
BEGIN
    FOR write IN SELECT w.value FROM jsonb_array_elements(p_writes) WITH ORDINALITY AS w
                 ORDER BY w.ordinality
    LOOP
        BEGIN
            outcomes := outcomes || (converger_commit_batch(jsonb_build_array(write)) -> 0);
        EXCEPTION WHEN OTHERS THEN
            outcomes := outcomes || jsonb_build_object(
                'failed', jsonb_build_object('sqlstate', SQLSTATE, 'message', SQLERRM));
        END;
    END LOOP;
    RETURN to_jsonb(outcomes);
END
$$;
