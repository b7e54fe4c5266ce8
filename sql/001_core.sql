-- agentd core schema: every invariant the queue relies on lives here, not in Python.
-- Statuses repeat agentd.vocabulary; tests/integration/test_schema.py keeps the two in step.

CREATE TABLE account (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name        text NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 200),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE device (
    id            uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    account_id    uuid NOT NULL REFERENCES account (id) ON DELETE CASCADE,
    name          text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    -- sha256 of the bearer token; the token itself is never stored
    token_hash    bytea NOT NULL UNIQUE,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_seen_at  timestamptz,
    revoked_at    timestamptz
);
CREATE INDEX device_account_idx ON device (account_id);

CREATE TABLE conversation (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    account_id  uuid NOT NULL REFERENCES account (id) ON DELETE CASCADE,
    title       text NOT NULL DEFAULT '' CHECK (length(title) <= 500),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX conversation_account_idx ON conversation (account_id, updated_at DESC);

-- The fence: a monotonic token stamped by every claim; orders executions, which a uuid cannot.
CREATE SEQUENCE agent_run_fence_seq AS bigint;

CREATE TABLE agent_run (
    id                 uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    account_id         uuid NOT NULL REFERENCES account (id) ON DELETE CASCADE,
    conversation_id    uuid NOT NULL REFERENCES conversation (id) ON DELETE CASCADE,
    user_message_id    uuid NOT NULL,
    origin_device_id   uuid REFERENCES device (id) ON DELETE SET NULL,
    status             text NOT NULL DEFAULT 'queued'
                       CHECK (status IN ('queued', 'running', 'completed', 'failed', 'cancelled')),
    request            jsonb,
    request_hash       text NOT NULL,
    idempotency_key    text CHECK (length(idempotency_key) BETWEEN 1 AND 200),
    worker_id          text,
    claim_token        uuid,
    fence              bigint,
    -- The one lease deadline (database clock). conversation_lease joins here; never copied.
    lease_expires_at   timestamptz,
    last_heartbeat_at  timestamptz,
    cancel_requested   boolean NOT NULL DEFAULT false,
    error              text,
    usage              jsonb,
    created_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    started_at         timestamptz,
    finished_at        timestamptz,
    -- a running run always carries its claim; a queued one never does
    CONSTRAINT agent_run_claim_shape CHECK (
        status <> 'running'
        OR (claim_token IS NOT NULL AND fence IS NOT NULL AND lease_expires_at IS NOT NULL
            AND worker_id IS NOT NULL)),
    CONSTRAINT agent_run_queued_unclaimed CHECK (status <> 'queued' OR claim_token IS NULL),
    CONSTRAINT agent_run_terminal_finished CHECK (
        status IN ('queued', 'running') OR finished_at IS NOT NULL)
);

-- Rule 5: one turn at a time per conversation, below every snapshot.
CREATE UNIQUE INDEX one_running_per_conversation ON agent_run (conversation_id)
    WHERE status = 'running';
-- The claim's scan: queued runs in arrival order.
CREATE INDEX agent_run_queued_idx ON agent_run (created_at, id) WHERE status = 'queued';
-- The claim's per-conversation FIFO check and the stop sweep.
CREATE INDEX agent_run_conversation_active_idx ON agent_run (conversation_id, created_at)
    WHERE status IN ('queued', 'running');
-- The reaper's scan.
CREATE INDEX agent_run_running_deadline_idx ON agent_run (lease_expires_at)
    WHERE status = 'running';
CREATE INDEX agent_run_conversation_idx ON agent_run (conversation_id, created_at);
-- A repeated Idempotency-Key returns the first run instead of minting a second.
CREATE UNIQUE INDEX agent_run_idempotency_key ON agent_run (account_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE TABLE message (
    id               uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    conversation_id  uuid NOT NULL REFERENCES conversation (id) ON DELETE CASCADE,
    run_id           uuid REFERENCES agent_run (id) ON DELETE SET NULL,
    -- transcript order; a sequence so messages written in one transaction keep their order
    position         bigint GENERATED ALWAYS AS IDENTITY,
    role             text NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
    content          text NOT NULL,
    status           text NOT NULL
                     CHECK (status IN ('queued', 'complete', 'partial', 'cancelled', 'draft')),
    -- assistant: the tool calls it asked for; tool: the call it answers
    tool_calls       jsonb,
    tool_call_id     text,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX message_conversation_idx ON message (conversation_id, position);
CREATE INDEX message_run_idx ON message (run_id);

ALTER TABLE agent_run ADD CONSTRAINT agent_run_user_message_fk
    FOREIGN KEY (user_message_id) REFERENCES message (id) DEFERRABLE INITIALLY DEFERRED;

CREATE TABLE run_event (
    run_id      uuid NOT NULL REFERENCES agent_run (id) ON DELETE CASCADE,
    seq         bigint NOT NULL CHECK (seq >= 1),
    type        text NOT NULL CHECK (type IN ('user_message', 'run_queued', 'run_started',
                    'content_delta', 'tool_call', 'tool_result', 'cancel_requested', 'complete')),
    payload     jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- one writer per seq: a second writer of the same position fails instead of interleaving
    PRIMARY KEY (run_id, seq)
);
-- Never two endings for one run, whoever tries to write the second.
CREATE UNIQUE INDEX one_complete_per_run ON run_event (run_id) WHERE type = 'complete';
CREATE INDEX run_event_created_idx ON run_event (created_at);

-- Seed 000: which execution owns the conversation. Its deadline is the owning run's
-- lease_expires_at (joined, never copied), so renewal and expiry have one source of truth.
CREATE TABLE conversation_lease (
    account_id       uuid NOT NULL REFERENCES account (id) ON DELETE CASCADE,
    conversation_id  uuid NOT NULL REFERENCES conversation (id) ON DELETE CASCADE,
    run_id           uuid NOT NULL REFERENCES agent_run (id) ON DELETE CASCADE,
    execution_id     uuid NOT NULL,
    fence            bigint NOT NULL,
    worker_id        text NOT NULL,
    device_id        uuid REFERENCES device (id) ON DELETE SET NULL,
    acquired_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (account_id, conversation_id)
);
CREATE INDEX conversation_lease_run_idx ON conversation_lease (run_id);
