-- The journal's index on created_at goes: no statement reads run_event by time (tails read a
-- run's rows by (run_id, seq), retention deletes by run), and every journal row paid for it —
-- the hottest insert of all, at least six rows per turn and one per flush while a turn streams.
DROP INDEX run_event_created_idx;
