-- Every live agentd process, and the text of failed turns.

-- One row per process start (its worker id: host, pid, random suffix), renewed by the same beat
-- statement that renews the leases of the runs it holds. `agentd status` lists the rows whose
-- beat deadline is ahead (database clock); a process that dies simply stops renewing its row.
-- The figures are what that process measured just before the beat: the fleet's load at a glance.
CREATE TABLE worker (
    id                text PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 300),
    host              text NOT NULL,
    pid               integer NOT NULL,
    listen            text,
    version           text,
    started_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_beat_at      timestamptz NOT NULL,
    -- live while ahead of the database clock: one lease_ttl_s after the last beat
    expires_at        timestamptz NOT NULL,
    runs_in_flight    integer NOT NULL DEFAULT 0 CHECK (runs_in_flight >= 0),
    max_runs          integer NOT NULL DEFAULT 0 CHECK (max_runs >= 0),
    -- the worst event-loop lag and pool wait seen since the previous beat, in milliseconds
    loop_lag_ms       double precision NOT NULL DEFAULT 0,
    pool_wait_ms      double precision NOT NULL DEFAULT 0,
    -- false while the process holds back from claiming (its loop lags or its pool waits)
    admitting         boolean NOT NULL DEFAULT true
);
CREATE INDEX worker_expires_idx ON worker (expires_at);

-- A turn that failed keeps the text its clients already saw: the assistant message of a failed
-- run has status `failed` (its journal's content deltas, stored with the terminal write).
ALTER TABLE message DROP CONSTRAINT message_status_check;
ALTER TABLE message ADD CONSTRAINT message_status_check
    CHECK (status IN ('queued', 'complete', 'partial', 'cancelled', 'draft', 'failed'));

-- The text a run's journal holds: its content deltas in seq order. What every client of the run
-- saw, so whoever finalizes a run `failed` stores exactly this as its answer.
CREATE FUNCTION journal_text(of_run uuid) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce(string_agg(e.payload ->> 'delta', '' ORDER BY e.seq), '')
    FROM run_event e
    WHERE e.run_id = of_run AND e.type = 'content_delta';
$$;
