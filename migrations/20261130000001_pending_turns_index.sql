-- A node that starts serving a channel reads the channel's unanswered turns back (takeover
-- memory); only pending rows are interesting, and they are few.
CREATE INDEX turns_pending_idx ON turns (created_at) WHERE status = 'pending';
