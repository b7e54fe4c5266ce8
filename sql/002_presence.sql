-- Presence: which devices hold a conversation stream open right now. A short renewable row per
-- open stream; gone when the stream ends, or expired by the database clock if its server died.
CREATE TABLE presence (
    id               uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    account_id       uuid NOT NULL REFERENCES account (id) ON DELETE CASCADE,
    conversation_id  uuid NOT NULL REFERENCES conversation (id) ON DELETE CASCADE,
    device_id        uuid NOT NULL REFERENCES device (id) ON DELETE CASCADE,
    since            timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at       timestamptz NOT NULL
);
CREATE INDEX presence_conversation_idx ON presence (conversation_id, expires_at);
