-- Lease mode: a member's node renews and releases the leases it holds by holder; only pending,
-- claimed rows are interesting.
CREATE INDEX turns_claimed_idx ON turns (claimed_by) WHERE status = 'pending' AND claimed_by IS NOT NULL;
