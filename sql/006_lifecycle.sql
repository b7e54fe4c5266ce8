-- The life cycle of a conversation: its model, its archive mark, and exchanges a retry or an
-- edit replaced (kept in the transcript, marked, never deleted).

ALTER TABLE conversation
    -- `<provider>:<model>` runs default to; NULL: the daemon's default_model
    ADD COLUMN model text CHECK (model IS NULL OR length(model) BETWEEN 1 AND 200),
    -- archived conversations are hidden from the list, reversibly
    ADD COLUMN archived_at timestamptz;

-- The user message of the exchange that replaced this one (a retry or an edit). Such messages
-- stay in the transcript for people; the model of a later turn never sees them.
ALTER TABLE message
    ADD COLUMN superseded_by uuid REFERENCES message (id) ON DELETE SET NULL;
-- A conversation feed re-reads its superseded messages; the foreign key's own lookups (when a
-- conversation is deleted) use the second index.
CREATE INDEX message_superseded_idx ON message (conversation_id)
    WHERE superseded_by IS NOT NULL;
CREATE INDEX message_superseded_by_idx ON message (superseded_by)
    WHERE superseded_by IS NOT NULL;

-- Deleting a conversation deletes its messages and runs: the foreign keys pointing at them are
-- checked per deleted row, which without these indexes is a scan of the whole table each time.
CREATE INDEX agent_run_user_message_idx ON agent_run (user_message_id);
CREATE INDEX conversation_note_run_idx ON conversation_note (run_id) WHERE run_id IS NOT NULL;
