-- Fair and bounded: per-account limits, the counts the fair claim reads, and run error codes.

-- An operator's limits for one account; NULL means the fleet's default (settings
-- account_max_running, account_max_queued; every model). In the database, so every daemon of a
-- fleet enforces the same ones.
ALTER TABLE account
    ADD COLUMN max_running integer CHECK (max_running BETWEEN 0 AND 10000),
    ADD COLUMN max_queued integer CHECK (max_queued BETWEEN 0 AND 1000000),
    -- model patterns (`demo`, `openai:*`, `local:smollm2`): a run may name only a model one of
    -- them matches
    ADD COLUMN models text[] CHECK (cardinality(models) BETWEEN 1 AND 100);

-- Each account's queued and running turns, counted as they change, and when it was last served:
-- the fair claim orders accounts by it (round robin) and admits a turn only below the account's
-- running limit, the enqueue only below its queued limit. Both lock this row to decide, so two
-- daemons can never together exceed a limit; the trigger below keeps the counts exact.
CREATE TABLE account_runs (
    account_id       uuid PRIMARY KEY REFERENCES account (id) ON DELETE CASCADE,
    queued           integer NOT NULL DEFAULT 0 CHECK (queued >= 0),
    running          integer NOT NULL DEFAULT 0 CHECK (running >= 0),
    last_claimed_at  timestamptz
);
INSERT INTO account_runs (account_id, queued, running, last_claimed_at)
SELECT a.id, count(r.id) FILTER (WHERE r.status = 'queued'),
       count(r.id) FILTER (WHERE r.status = 'running'), max(r.started_at)
FROM account a LEFT JOIN agent_run r ON r.account_id = a.id
GROUP BY a.id;

CREATE FUNCTION add_account_runs() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO account_runs (account_id) VALUES (NEW.id);
    RETURN NULL;
END;
$$;
CREATE TRIGGER account_runs_row AFTER INSERT ON account
    FOR EACH ROW EXECUTE FUNCTION add_account_runs();

-- Every run entering or leaving `queued` or `running` moves its account's counts, whoever
-- writes it (enqueue, claim, finish, reaper, stop, a deleted conversation); a run entering
-- `running` also marks its account as just served.
CREATE FUNCTION count_account_runs() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    queued_by integer := 0;
    running_by integer := 0;
    served boolean := false;
    of_account uuid;
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        of_account := OLD.account_id;
        queued_by := queued_by - (OLD.status = 'queued')::integer;
        running_by := running_by - (OLD.status = 'running')::integer;
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') THEN
        of_account := NEW.account_id;
        queued_by := queued_by + (NEW.status = 'queued')::integer;
        running_by := running_by + (NEW.status = 'running')::integer;
        served := NEW.status = 'running' AND (TG_OP = 'INSERT' OR OLD.status <> 'running');
    END IF;
    IF queued_by <> 0 OR running_by <> 0 THEN
        UPDATE account_runs
        SET queued = queued + queued_by, running = running + running_by,
            last_claimed_at = CASE WHEN served THEN clock_timestamp() ELSE last_claimed_at END
        WHERE account_id = of_account;
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER count_account_runs AFTER INSERT OR DELETE OR UPDATE OF status ON agent_run
    FOR EACH ROW EXECUTE FUNCTION count_account_runs();

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
