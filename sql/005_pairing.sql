-- Pairing: one-time codes a new device trades for its bearer token (docs/operations.md,
-- "Pairing"). Only the code's SHA-256 is stored. A code is spent by the same statement that
-- creates the device (redeem_pairing), so it can never mint two devices.
CREATE TABLE pairing (
    code_hash    bytea PRIMARY KEY,
    account_id   uuid NOT NULL REFERENCES account (id) ON DELETE CASCADE,
    -- the name the new device gets; NULL: the redeemer names it
    device_name  text CHECK (length(device_name) BETWEEN 1 AND 200),
    -- the device that asked for the code; NULL: the operator (`agentd pair`)
    created_by   uuid REFERENCES device (id) ON DELETE CASCADE,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at   timestamptz NOT NULL,
    used_at      timestamptz,
    -- the device the code created (its id is chosen by the spending UPDATE, hence deferred)
    device_id    uuid REFERENCES device (id) ON DELETE SET NULL DEFERRABLE INITIALLY DEFERRED,
    CONSTRAINT pairing_expiry_after_creation CHECK (expires_at > created_at),
    CONSTRAINT pairing_used_once CHECK (used_at IS NOT NULL OR device_id IS NULL)
);
CREATE INDEX pairing_expires_idx ON pairing (expires_at);
