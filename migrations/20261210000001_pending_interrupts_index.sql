-- A session's welcome lists the conversation's interrupts that no frame resolved yet. The
-- look-up went through the conversation's frames, every one of them, to find the few that are
-- interrupts: a hello into a conversation of 5,000 frames read about 165 pages. This partial
-- index holds only interrupts, so the look-up reads a page or two however long the
-- conversation is, and no other frame writes an entry (ADR 0044).
--
-- IF NOT EXISTS: an operator with a large `activities` table may build the same index first
-- with CREATE INDEX CONCURRENTLY, so that this migration does not hold writes for the build
-- (docs/operations.md, rolling upgrades).
CREATE INDEX IF NOT EXISTS activities_interrupts
    ON activities (conversation_id, seq) WHERE type = 'interrupt';
