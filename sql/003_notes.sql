-- Notes: a per-conversation notebook the `notes` tool writes, and the downstream fencing of seed
-- 000. The notebook keeps the highest fence it has seen per conversation; a write carrying a
-- lower fence comes from a superseded execution and is rejected whole.
CREATE TABLE conversation_note_fence (
    conversation_id  uuid PRIMARY KEY REFERENCES conversation (id) ON DELETE CASCADE,
    -- the high-water mark: only ever raised, by a write that carries a higher fence
    fence            bigint NOT NULL,
    run_id           uuid NOT NULL,
    updated_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE conversation_note (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    conversation_id  uuid NOT NULL REFERENCES conversation (id) ON DELETE CASCADE,
    run_id           uuid REFERENCES agent_run (id) ON DELETE SET NULL,
    fence            bigint NOT NULL,
    text             text NOT NULL CHECK (length(text) BETWEEN 1 AND 4000),
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX conversation_note_conversation_idx ON conversation_note (conversation_id, id);
