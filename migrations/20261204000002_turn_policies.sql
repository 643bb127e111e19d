-- Double texting and cancel on disconnect (ADR 0029). A channel's turn policy (NULL: the node's
-- configured default), the policies a send may ask for instead, and whether the last end-user
-- connection of a conversation leaving cancels its running turn (NULL: `continue`). A turn a
-- newer one rolled back (policy `rollback`) leaves the chat view with its answers.

ALTER TABLE channels ADD COLUMN turn_policy text
    CHECK (turn_policy IN ('enqueue', 'reject', 'interrupt', 'rollback'));
ALTER TABLE channels ADD COLUMN turn_policy_overrides text[] NOT NULL DEFAULT '{}'
    CHECK (turn_policy_overrides <@ ARRAY['enqueue', 'reject', 'interrupt', 'rollback']);
ALTER TABLE channels ADD COLUMN on_disconnect text
    CHECK (on_disconnect IN ('continue', 'cancel'));
ALTER TABLE turns ADD COLUMN rolled_back boolean NOT NULL DEFAULT false;
