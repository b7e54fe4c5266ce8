-- Two of agent_run's indexes go: every turn wrote their entries, and narrower indexes serve
-- their readers. And a tenth of each new page of runs is left free, for renewals.
--
-- A turn's row gets a new version, with an entry in every index whose predicate it meets, when
-- it is enqueued, claimed and finished, and at every lease renewal while it runs (a renewal
-- cannot be a heap-only update while lease_expires_at is indexed). Per turn that was 17 index
-- entries of agent_run before this, plus 7 per renewal; docs/benchmarks.md has the measurements.
--
-- * agent_run_conversation_active_idx (conversation_id, created_at) WHERE queued or running:
--   the claim stopped reading it in sql/011. Its readers left (a conversation's active runs:
--   the stop sweep and the active-turn list; the fleet's counts) write the two states as
--   `status = 'queued' OR status = 'running'`, which PostgreSQL answers from the two partial
--   indexes each state has already (a BitmapOr), where `status IN (...)` would not match them.
-- * agent_run_running_deadline_idx (lease_expires_at) WHERE running: read only by the reaper,
--   every reap_interval_s, which now walks the running runs (as many as the fleet runs turns)
--   through a running-only index instead; and without it a lease renewal changes no indexed
--   column, so it can be a heap-only update, writing no index entry at all.
DROP INDEX agent_run_conversation_active_idx;
DROP INDEX agent_run_running_deadline_idx;
-- * fillfactor 90: a heap-only update needs room on its row's page. With pages filled by new
--   runs to the brim, 45% of renewals found it (300 running runs renewed 20 times on a fresh
--   table); leaving a tenth of each page free, 84%, and WAL per renewal went 492 -> 212 bytes
--   (829 with the deadline index). Applies to pages written from now on.
ALTER TABLE agent_run SET (fillfactor = 90);
