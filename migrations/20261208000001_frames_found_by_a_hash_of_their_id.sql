-- Frames are found by id (a conversation's known message ids, the turn a message id names, an
-- interrupt's resolution) through a 64-bit hash of the id instead of the id's text (ADR 0040).
-- An entry of (conversation, id) was a uuid and a 36-character id, 64 bytes; with the hash it
-- is 32. Every frame writes one, so its WAL and its share of page splits halve. Hashes can
-- collide, so every query that uses the index compares the id itself as well.
--
-- IF NOT EXISTS: an operator with a large `activities` table may build the same index first
-- with CREATE INDEX CONCURRENTLY, so that this migration does not hold writes for the build
-- (docs/operations.md, rolling upgrades).
CREATE INDEX IF NOT EXISTS activities_by_id_hash
    ON activities (conversation_id, hashtextextended(id, 0));
DROP INDEX IF EXISTS activities_by_id;
