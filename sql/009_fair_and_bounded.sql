-- Fair and bounded: per-account limits, the fair claim's bookkeeping, and run error codes.

-- An operator's limits for one account; NULL means the fleet's default (settings
-- account_max_running, account_max_queued; every model). In the database, so every daemon of a
-- fleet enforces the same ones.
ALTER TABLE account
    ADD COLUMN max_running integer CHECK (max_running BETWEEN 0 AND 10000),
    ADD COLUMN max_queued integer CHECK (max_queued BETWEEN 0 AND 1000000),
    -- model patterns (`demo`, `openai:*`, `local:smollm2`): a run may name only a model one of
    -- them matches
    ADD COLUMN models text[] CHECK (cardinality(models) BETWEEN 1 AND 100);

-- When each account was last served: the fair claim orders accounts by it (round robin).
ALTER TABLE account ADD COLUMN last_claimed_at timestamptz;

-- The limits are decided under a lock on the account's row, by counts read AFTER the lock was
-- granted: these functions are VOLATILE, so each query in them takes a fresh snapshot (a
-- statement's own snapshot predates its lock wait and would miss the turns the previous lock
-- holder just committed). Claims and enqueues of one account serialize on the row; finishes
-- and stops never touch it (a turn whose ending is not yet committed still counts: never
-- over the limit, at worst one claim later). FOR NO KEY UPDATE does not conflict with the key
-- share locks new runs and conversations take on their account.

-- How many more turns the account may start now (its max_running, else $2).
CREATE FUNCTION account_running_room(of_account uuid, default_max integer) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    cap integer;
    running integer;
BEGIN
    SELECT coalesce(a.max_running, default_max) INTO cap
    FROM account a WHERE a.id = of_account FOR NO KEY UPDATE;
    SELECT count(*) INTO running
    FROM agent_run r WHERE r.account_id = of_account AND r.status = 'running';
    RETURN greatest(cap - running, 0);
END;
$$;

-- Whether the account may queue one more turn (its max_queued, else $2).
CREATE FUNCTION account_queue_has_room(of_account uuid, default_max integer) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    cap integer;
    queued integer;
BEGIN
    SELECT coalesce(a.max_queued, default_max) INTO cap
    FROM account a WHERE a.id = of_account FOR NO KEY UPDATE;
    -- Counting stops at the cap: a deep queue costs no more than a full one.
    SELECT count(*) INTO queued FROM (
        SELECT 1 FROM agent_run r
        WHERE r.account_id = of_account AND r.status = 'queued'
        LIMIT cap) AS upto;
    RETURN queued < cap;
END;
$$;

-- The running-limit count: an account's running turns.
CREATE INDEX agent_run_account_running_idx ON agent_run (account_id) WHERE status = 'running';
-- The fair claim's scan: an account's queued turns in arrival order.
CREATE INDEX agent_run_account_queued_idx ON agent_run (account_id, created_at, id)
    WHERE status = 'queued';

-- Why a run failed, as a stable code for clients (agentd.vocabulary.RunErrorCode); `error`
-- holds a short message fit for any client, the full detail is in the daemon's log.
ALTER TABLE agent_run ADD COLUMN error_code text CHECK (error_code IN (
    'deadline_exceeded', 'provider_error', 'provider_timeout', 'provider_unavailable',
    'provider_auth', 'provider_rate_limited', 'provider_rejected', 'model_unavailable',
    'tool_steps_exceeded', 'lease_expired', 'shutdown', 'internal_error',
    'stopped_before_start'));

-- A run as readers see it, now with its error code (columns append: the view keeps its shape).
CREATE OR REPLACE VIEW agent_run_with_device AS
SELECT r.id, r.account_id, r.conversation_id, r.user_message_id, r.origin_device_id,
       d.name AS origin_device, r.status, r.request, r.idempotency_key, r.worker_id,
       r.claim_token, r.fence, r.lease_expires_at, r.last_heartbeat_at, r.cancel_requested,
       r.error, r.usage, r.created_at, r.started_at, r.finished_at, r.error_code
FROM agent_run r
LEFT JOIN device d ON d.id = r.origin_device_id;
