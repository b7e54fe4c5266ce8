-- Every statement agentd sends, by name. Bound parameters only; no SQL is built from input.
-- Format: a "-- name --" line, comment lines naming the invariant it protects, the statement.
-- All lease comparisons use clock_timestamp() (the database clock, sampled once per statement).

-- enqueue_run --
-- Rule 1: the user message, the run, journal seq 1-2 and the wake commit as ONE statement.
-- A repeated idempotency key inserts nothing (the unique index arbitrates, even mid-flight).
-- The conversation row is locked first, so runs of one conversation get created_at in commit
-- order (a conversation feed's watermark relies on it) and on_busy checks serialize with us.
WITH conv AS (
    UPDATE conversation SET updated_at = clock_timestamp()
    WHERE id = $2::uuid AND account_id = $1::uuid
    RETURNING id, account_id
), run AS (
    INSERT INTO agent_run (account_id, conversation_id, user_message_id, origin_device_id,
                           request, request_hash, idempotency_key, created_at)
    SELECT conv.account_id, conv.id, gen_random_uuid(), $3::uuid, $5::jsonb, $6::text, $7::text,
           clock_timestamp()
    FROM conv
    ON CONFLICT (account_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, conversation_id, user_message_id, status, created_at
), msg AS (
    INSERT INTO message (id, conversation_id, run_id, role, content, status)
    SELECT user_message_id, conversation_id, id, 'user', $4::text, 'queued' FROM run
), journal AS (
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT run.id, e.seq, e.type, e.payload
    FROM run CROSS JOIN LATERAL (VALUES
        (1, 'user_message', jsonb_build_object(
            'message_id', run.user_message_id, 'role', 'user', 'content', $4::text)),
        (2, 'run_queued', jsonb_build_object(
            'run_id', run.id, 'conversation_id', run.conversation_id, 'device_id', $3::uuid,
            'device', (SELECT name FROM device WHERE id = $3::uuid)))
    ) AS e (seq, type, payload)
)
SELECT run.id, run.status, run.conversation_id, run.user_message_id, run.created_at,
       pg_notify('agentd_run_enqueued', run.conversation_id::text),
       pg_notify('agentd_conversation', run.conversation_id::text)
FROM run;

-- find_run_by_idempotency_key --
-- The first run minted for a key, so a retried POST answers with it instead of a second run.
SELECT id, status, conversation_id, request_hash
FROM agent_run
WHERE account_id = $1::uuid AND idempotency_key = $2::text;

-- claim_runs --
-- Rule 2: claim in one statement; SKIP LOCKED so claimers pass over each other, never wait.
-- Only the oldest queued turn of a conversation with nothing running is eligible (FIFO, rule 5);
-- the pre-filter can be fooled by snapshots, the one_running_per_conversation index cannot.
-- Stamps a fresh claim_token, a monotonic fence and a deadline on the database clock, and
-- acquires the seed-000 conversation lease: its conditional UPSERT takes over only a holder
-- whose run is no longer live (leased = false means not acquired; the caller rolls back),
-- and journals run_started (worker, fence, deadline); last_seq is that event's seq.
WITH clock AS (
    SELECT clock_timestamp() AS now
), picked AS (
    SELECT r.id
    FROM agent_run r
    WHERE r.status = 'queued'
      AND NOT EXISTS (
          SELECT 1 FROM agent_run busy
          WHERE busy.conversation_id = r.conversation_id AND busy.status = 'running')
      AND NOT EXISTS (
          SELECT 1 FROM agent_run older
          WHERE older.conversation_id = r.conversation_id AND older.status = 'queued'
            AND (older.created_at, older.id) < (r.created_at, r.id))
    ORDER BY r.created_at, r.id
    LIMIT $3::int
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE agent_run r
    SET status = 'running',
        claim_token = gen_random_uuid(),
        fence = nextval('agent_run_fence_seq'),
        worker_id = $1::text,
        lease_expires_at = clock.now + make_interval(secs => $2::float8),
        last_heartbeat_at = clock.now,
        started_at = clock.now
    FROM picked, clock
    WHERE r.id = picked.id AND r.status = 'queued'
    RETURNING r.id, r.account_id, r.conversation_id, r.user_message_id, r.origin_device_id,
              r.request, r.claim_token, r.fence, r.worker_id, r.lease_expires_at,
              r.cancel_requested
), asked AS (
    UPDATE message m SET status = 'complete'
    FROM claimed
    WHERE m.id = claimed.user_message_id AND m.status = 'queued'
), lease AS (
    INSERT INTO conversation_lease AS held (account_id, conversation_id, run_id, execution_id,
                                            fence, worker_id, device_id, acquired_at)
    SELECT c.account_id, c.conversation_id, c.id, c.claim_token, c.fence, c.worker_id,
           c.origin_device_id, clock.now
    FROM claimed c, clock
    ON CONFLICT (account_id, conversation_id) DO UPDATE
    SET run_id = EXCLUDED.run_id,
        execution_id = EXCLUDED.execution_id,
        fence = EXCLUDED.fence,
        worker_id = EXCLUDED.worker_id,
        device_id = EXCLUDED.device_id,
        acquired_at = EXCLUDED.acquired_at
    WHERE NOT EXISTS (
        SELECT 1 FROM agent_run holder, clock
        WHERE holder.id = held.run_id AND holder.claim_token = held.execution_id
          AND holder.status = 'running' AND holder.lease_expires_at > clock.now)
    RETURNING run_id
), started AS (
    -- The claim journals its own run_started: one commit less before the first token. It is
    -- the claimer's first write; it rolls back with the claim if the lease was not acquired.
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT c.id, (SELECT max(e.seq) FROM run_event e WHERE e.run_id = c.id) + 1,
           'run_started',
           jsonb_build_object('worker_id', c.worker_id, 'fence', c.fence,
                              'lease_expires_at', to_char(c.lease_expires_at AT TIME ZONE 'UTC',
                                                          'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))
    FROM claimed c
    RETURNING run_id, seq
)
SELECT c.*, started.seq AS last_seq,
       EXISTS (SELECT 1 FROM lease WHERE lease.run_id = c.id) AS leased
FROM claimed c JOIN started ON started.run_id = c.id;

-- heartbeat --
-- Rule 3: renew only a lease we still hold. Token + status + unexpired deadline, so a late beat
-- can never revive an execution the reaper may already have judged dead. Zero rows = LeaseLost.
-- Returns the cancel flag: the heartbeat is also the missed-NOTIFY poll for stops (rule 8).
UPDATE agent_run r
SET lease_expires_at = clock.now + make_interval(secs => $3::float8),
    last_heartbeat_at = clock.now
FROM (SELECT clock_timestamp() AS now) clock
WHERE r.id = $1::uuid AND r.claim_token = $2::uuid AND r.status = 'running'
  AND r.lease_expires_at > clock.now
RETURNING r.cancel_requested, r.lease_expires_at;

-- check_lease --
-- Seed 000: before a turn's first write, the granted deadline must still be ahead (database
-- clock) and the claim still ours; zero rows = LeaseLost. Read-only, so no synchronous commit
-- delays the start (the claim has just granted a full lease). Also reads the cancel flag after
-- the worker subscribed to stop hints, so a stop that landed in between is not missed.
SELECT cancel_requested, lease_expires_at
FROM agent_run
WHERE id = $1::uuid AND claim_token = $2::uuid AND status = 'running'
  AND lease_expires_at > clock_timestamp();

-- append_events_fenced --
-- Rule 7: a worker's journal batch lands whole or not at all, only while it owns the run.
-- FOR SHARE on the run row serializes with the reaper and stop, so a finalizer's max(seq)+1
-- never races an append; zero rows written = LeaseLost. Its wake hint is sent after the commit
-- (notifier.py), so nobody is woken for a batch that rolled back.
WITH owner AS (
    SELECT id FROM agent_run
    WHERE id = $1::uuid AND claim_token = $2::uuid AND status = 'running'
      AND lease_expires_at > clock_timestamp()
    FOR SHARE
), written AS (
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT owner.id, e.seq, e.type, e.payload::jsonb
    FROM owner, unnest($3::bigint[], $4::text[], $5::text[]) AS e (seq, type, payload)
    RETURNING seq
)
SELECT (SELECT count(*) FROM written) AS written
FROM owner;

-- insert_message_fenced --
-- A worker's transcript write (assistant tool-call turns, tool results) lands only while it
-- owns the run; a zombie writes zero rows.
WITH owner AS (
    SELECT id, conversation_id FROM agent_run
    WHERE id = $1::uuid AND claim_token = $2::uuid AND status = 'running'
      AND lease_expires_at > clock_timestamp()
    FOR SHARE
)
INSERT INTO message (conversation_id, run_id, role, content, status, tool_calls, tool_call_id)
SELECT owner.conversation_id, owner.id, $3::text, $4::text, $5::text, $6::jsonb, $7::text
FROM owner
RETURNING id;

-- finish_run_fenced --
-- Rule 3: the worker's terminal write. Fenced like every other write; terminal states are
-- sticky (status = 'running' in the WHERE). In the same statement: the answer message, the one
-- 'complete' event (seq $8, or max+1 for the dispatcher's backstop) and the lease release by
-- execution id. The caller sends the knock that starts the next turn right after the commit.
WITH clock AS (
    SELECT clock_timestamp() AS now
), fin AS (
    UPDATE agent_run r
    SET status = $3::text, error = $4::text, usage = $5::jsonb, finished_at = clock.now
    FROM clock
    WHERE r.id = $1::uuid AND r.claim_token = $2::uuid AND r.status = 'running'
      AND r.lease_expires_at > clock.now
    RETURNING r.id, r.account_id, r.conversation_id, r.claim_token
), answer AS (
    INSERT INTO message (conversation_id, run_id, role, content, status)
    SELECT fin.conversation_id, fin.id, 'assistant', $6::text, $7::text
    FROM fin
    WHERE $6::text IS NOT NULL
    RETURNING id
), ended AS (
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT fin.id,
           coalesce($8::bigint,
                    (SELECT max(e.seq) + 1 FROM run_event e WHERE e.run_id = fin.id)),
           'complete',
           jsonb_build_object('status', $3::text, 'error', $4::text,
                              'message_id', (SELECT id FROM answer), 'usage', $5::jsonb)
    FROM fin
), released AS (
    DELETE FROM conversation_lease l
    USING fin
    WHERE l.account_id = fin.account_id AND l.conversation_id = fin.conversation_id
      AND l.execution_id = fin.claim_token
), repaired AS (
    -- Backstop for a worker that crashed mid-tool: unanswered calls get `cancelled` results.
    INSERT INTO message (conversation_id, run_id, role, content, status, tool_call_id)
    SELECT m.conversation_id, m.run_id, 'tool', '{"error": "cancelled"}', 'cancelled',
           call ->> 'id'
    FROM message m
    JOIN fin ON fin.id = m.run_id
    CROSS JOIN LATERAL jsonb_array_elements(m.tool_calls) AS call
    WHERE m.role = 'assistant' AND m.tool_calls IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM message t
                      WHERE t.run_id = m.run_id AND t.role = 'tool'
                        AND t.tool_call_id = call ->> 'id')
)
SELECT fin.id, fin.conversation_id, (SELECT id FROM answer) AS message_id
FROM fin;

-- reap_expired_runs --
-- Rules 3-4: finalize 'failed' only runs whose deadline has passed, re-checked inside this
-- write against the row as it is now (a heartbeat that landed first wins; SKIP LOCKED passes
-- over a run whose heartbeat is in flight). Never re-queued: at most once.
-- The caller journals the ending with journal_endings in the same transaction.
UPDATE agent_run r
SET status = 'failed',
    error = 'lease expired: worker ' || r.worker_id || ' stopped renewing it',
    finished_at = clock.now
FROM (SELECT clock_timestamp() AS now) clock
WHERE r.id IN (
        SELECT id FROM agent_run
        WHERE status = 'running'
          AND lease_expires_at <= clock_timestamp() - make_interval(secs => $1::float8)
        ORDER BY lease_expires_at
        LIMIT $2::int
        FOR UPDATE SKIP LOCKED)
  AND r.status = 'running'
  AND r.lease_expires_at <= clock.now - make_interval(secs => $1::float8)
RETURNING r.id, r.account_id, r.conversation_id, r.claim_token, r.status, r.error;

-- journal_endings --
-- Finalizers other than the worker (reaper, stop) append 'complete' at max(seq)+1. Run as its
-- own statement AFTER the fencing UPDATE in the same transaction: READ COMMITTED gives it a
-- fresh snapshot that sees every append committed before our row lock, and the lock holds off
-- the rest. one_complete_per_run makes a second ending impossible regardless.
-- Releases the runs' leases by execution id and knocks the queue. A turn a stop cancelled
-- before it started names its handed-back draft, so every stream can return it to its author.
WITH ended AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::text[],
                         $6::text[], $7::uuid[]) AS t (run_id, account_id, conversation_id,
                                                      claim_token, status, error, draft_id)
), journal AS (
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT ended.run_id,
           coalesce((SELECT max(e.seq) FROM run_event e WHERE e.run_id = ended.run_id), 0) + 1,
           'complete',
           jsonb_build_object('status', ended.status, 'error', ended.error, 'message_id', NULL)
           || CASE WHEN ended.draft_id IS NULL THEN '{}'::jsonb
                   ELSE jsonb_build_object('draft', jsonb_build_object(
                       'message_id', ended.draft_id,
                       'content', (SELECT content FROM message WHERE id = ended.draft_id)))
              END
    FROM ended
), released AS (
    DELETE FROM conversation_lease l
    USING ended
    WHERE l.account_id = ended.account_id AND l.conversation_id = ended.conversation_id
      AND l.execution_id = ended.claim_token
), repaired AS (
    -- A tool call the dead worker never answered gets a `cancelled` result, so the next
    -- turn's model request is well-formed.
    INSERT INTO message (conversation_id, run_id, role, content, status, tool_call_id)
    SELECT m.conversation_id, m.run_id, 'tool', '{"error": "cancelled"}', 'cancelled',
           call ->> 'id'
    FROM message m
    JOIN ended ON ended.run_id = m.run_id
    CROSS JOIN LATERAL jsonb_array_elements(m.tool_calls) AS call
    WHERE m.role = 'assistant' AND m.tool_calls IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM message t
                      WHERE t.run_id = m.run_id AND t.role = 'tool'
                        AND t.tool_call_id = call ->> 'id')
)
SELECT ended.run_id,
       pg_notify('agentd_run_event', ended.run_id::text),
       pg_notify('agentd_run_enqueued', ended.conversation_id::text),
       pg_notify('agentd_conversation', ended.conversation_id::text)
FROM ended;

-- release_lease --
-- Seed 000: release only by execution id. If A expired and B took over, A's late cleanup
-- matches zero rows and B's lease survives; zero rows is a normal, idempotent outcome.
DELETE FROM conversation_lease
WHERE account_id = $1::uuid AND conversation_id = $2::uuid AND execution_id = $3::uuid
RETURNING run_id;

-- lock_active_runs --
-- Rule 8: the stop sweep locks every active run of the conversation, queued and running,
-- in ONE transaction, so no claim or terminal wake can start a turn in the middle of it.
SELECT id, status
FROM agent_run
WHERE conversation_id = $1::uuid AND account_id = $2::uuid
  AND status IN ('queued', 'running')
ORDER BY created_at, id
FOR UPDATE;

-- cancel_queued_runs --
-- A queued turn never started: cancel it outright and hand its text back as a draft.
-- Runs only under lock_active_runs' locks; status = 'queued' re-checked in the write.
WITH cancelled AS (
    UPDATE agent_run r
    SET status = 'cancelled', error = 'stopped before it started',
        finished_at = clock_timestamp()
    WHERE r.id = ANY ($1::uuid[]) AND r.status = 'queued'
    RETURNING r.id, r.account_id, r.conversation_id, r.claim_token, r.status, r.error,
              r.user_message_id
), drafts AS (
    UPDATE message m SET status = 'draft'
    FROM cancelled
    WHERE m.id = cancelled.user_message_id
    RETURNING m.id, m.run_id, m.content
)
SELECT c.id, c.account_id, c.conversation_id, c.claim_token, c.status, c.error,
       d.id AS message_id, d.content
FROM cancelled c JOIN drafts d ON d.run_id = c.id;

-- request_cancel --
-- Rule 8: stop is a state. Flag running runs; the NOTIFY is only the fast path, the worker
-- re-reads the flag on every heartbeat. Terminal runs are untouched (sticky).
UPDATE agent_run
SET cancel_requested = true
WHERE id = ANY ($1::uuid[]) AND status = 'running'
RETURNING id, pg_notify('agentd_run_cancel', id::text);

-- notify_conversation --
-- Ownership or presence of a conversation changed: wake its feeds (they re-read rows).
SELECT pg_notify('agentd_conversation', $1::text);

-- read_events_after --
-- Rule 7: a tail is a cursor over the journal; any process can serve it.
SELECT seq, type, payload, created_at
FROM run_event
WHERE run_id = $1::uuid AND seq > $2::bigint
ORDER BY seq
LIMIT $3::int;

-- get_run --
-- Rule 9: a run is visible only to its own account. Names the device that asked.
SELECT r.id, r.account_id, r.conversation_id, r.user_message_id, r.origin_device_id,
       d.name AS origin_device, r.status, r.request, r.idempotency_key, r.worker_id,
       r.claim_token, r.fence, r.lease_expires_at, r.last_heartbeat_at, r.cancel_requested,
       r.error, r.usage, r.created_at, r.started_at, r.finished_at
FROM agent_run r
LEFT JOIN device d ON d.id = r.origin_device_id
WHERE r.id = $1::uuid AND r.account_id = $2::uuid;

-- list_messages --
-- The durable transcript in turn order: each run's answer follows its own question, even when
-- later questions were queued (written) before it ran.
SELECT m.id, m.run_id, m.role, m.content, m.status, m.tool_calls, m.tool_call_id, m.created_at
FROM message m
LEFT JOIN agent_run r ON r.id = m.run_id
LEFT JOIN message asked ON asked.id = r.user_message_id
WHERE m.conversation_id = $1::uuid
ORDER BY coalesce(asked.position, m.position), m.position;

-- list_active_runs --
-- The running turn and the queued ones behind it, in the order they will run.
SELECT r.id, r.account_id, r.conversation_id, r.user_message_id, r.origin_device_id,
       d.name AS origin_device, r.status, r.request, r.idempotency_key, r.worker_id,
       r.claim_token, r.fence, r.lease_expires_at, r.last_heartbeat_at, r.cancel_requested,
       r.error, r.usage, r.created_at, r.started_at, r.finished_at
FROM agent_run r
LEFT JOIN device d ON d.id = r.origin_device_id
WHERE r.conversation_id = $1::uuid AND r.status IN ('queued', 'running')
ORDER BY r.created_at, r.id;

-- get_conversation_lease --
-- Seed 000: who owns the conversation and until when. The deadline is joined from the owning
-- run (one source of truth); live is decided by the database clock.
SELECT l.run_id, l.execution_id, l.fence, l.worker_id, l.device_id, d.name AS device,
       r.lease_expires_at AS expires_at,
       (r.status = 'running' AND r.lease_expires_at > clock_timestamp()) AS live
FROM conversation_lease l
JOIN agent_run r ON r.id = l.run_id AND r.claim_token = l.execution_id
LEFT JOIN device d ON d.id = l.device_id
WHERE l.account_id = $1::uuid AND l.conversation_id = $2::uuid;

-- trim_journal --
-- Retention: the journal is a delivery buffer; the message table is the record. Trim events of
-- runs terminal for longer than the retention age and null their request snapshots.
WITH old AS (
    UPDATE agent_run SET request = NULL
    WHERE status IN ('completed', 'failed', 'cancelled')
      AND finished_at < clock_timestamp() - make_interval(secs => $1::float8)
      AND (request IS NOT NULL OR EXISTS (SELECT 1 FROM run_event e WHERE e.run_id = id))
    RETURNING id
)
DELETE FROM run_event e USING old WHERE e.run_id = old.id;

-- ensure_account --
-- Accounts are named; creating one that exists returns it (token create is re-runnable).
INSERT INTO account (name) VALUES ($1::text)
ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name
RETURNING id, name, created_at;

-- create_device --
-- A device credential; only the token's hash is stored (unique, so a hash names one device).
INSERT INTO device (account_id, name, token_hash)
VALUES ($1::uuid, $2::text, $3::bytea)
RETURNING id, account_id, name, created_at;

-- authenticate_device --
-- Rule 9: a bearer token resolves to (account, device) only while not revoked; marks it seen.
-- last_seen_at moves at most once a minute: writing it on every request put a synchronous
-- commit, and a row lock that all of a device's requests queue on, in front of every API call.
WITH found AS (
    SELECT d.id, d.name, d.account_id, a.name AS account_name
    FROM device d JOIN account a ON a.id = d.account_id
    WHERE d.token_hash = $1::bytea AND d.revoked_at IS NULL
), seen AS (
    UPDATE device d SET last_seen_at = clock_timestamp()
    FROM found
    WHERE d.id = found.id AND d.revoked_at IS NULL
      AND (d.last_seen_at IS NULL OR d.last_seen_at < clock_timestamp() - interval '1 minute')
)
SELECT found.id AS device_id, found.name AS device_name, found.account_id, found.account_name
FROM found;

-- list_devices --
-- Operators see every credential, never a token.
SELECT d.id, a.name AS account, d.name, d.created_at, d.last_seen_at, d.revoked_at
FROM device d JOIN account a ON a.id = d.account_id
ORDER BY a.name, d.created_at;

-- revoke_device --
-- Revocation is a timestamp, so audit keeps the row; a revoked token authenticates nothing.
UPDATE device SET revoked_at = clock_timestamp()
WHERE id = $1::uuid AND revoked_at IS NULL
RETURNING id;

-- create_conversation --
-- A conversation belongs to exactly one account from birth.
INSERT INTO conversation (account_id, title, model)
VALUES ($1::uuid, $2::text, $3::text)
RETURNING id, account_id, title, model, archived_at, created_at, updated_at;

-- get_conversation --
-- Rule 9: another account's conversation does not exist for you.
SELECT id, account_id, title, model, archived_at, created_at, updated_at
FROM conversation
WHERE id = $1::uuid AND account_id = $2::uuid;

-- list_conversations --
-- Most recently active first; archived ones only when asked for ($3), and then only them.
SELECT id, account_id, title, model, archived_at, created_at, updated_at
FROM conversation
WHERE account_id = $1::uuid AND (archived_at IS NOT NULL) = $3::bool
ORDER BY updated_at DESC, id
LIMIT $2::int;

-- migration_lock --
-- One migrator at a time across the fleet; the others wait, then find nothing left to do.
SELECT pg_advisory_lock($1::bigint);

-- migration_unlock --
-- Released explicitly: the migrator's session outlives the migrations.
SELECT pg_advisory_unlock($1::bigint);

-- create_schema_migrations --
-- The ledger of applied migrations, created before the first one runs.
CREATE TABLE IF NOT EXISTS schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    checksum    text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- list_applied_migrations --
-- What is already applied, with checksums so an edited migration is caught.
SELECT version, checksum FROM schema_migrations ORDER BY version;

-- record_migration --
-- Committed in the same transaction as the migration itself: applied exactly once.
INSERT INTO schema_migrations (version, name, checksum) VALUES ($1::int, $2::text, $3::text);

-- schema_migrations_exists --
-- Lets status/doctor report pending migrations on a database never migrated.
SELECT to_regclass('schema_migrations') IS NOT NULL;

-- ping --
-- Liveness probe for the hub's LISTEN connection and for readiness checks.
SELECT 1;

-- database_clock --
-- The daemon's clock is not trusted (rule 10): time comes from the database.
SELECT clock_timestamp();

-- database_exists --
-- The embedded server's database is created once, on first start.
SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1::text);

-- create_agentd_database --
-- A fixed name (identifiers cannot be bound parameters); used only on the embedded server.
CREATE DATABASE agentd;

-- queue_status --
-- What `agentd status` shows: queue depth, running turns and the workers holding live leases.
SELECT
    count(*) FILTER (WHERE status = 'queued') AS queued,
    count(*) FILTER (WHERE status = 'running') AS running,
    count(*) FILTER (WHERE status = 'running' AND lease_expires_at <= clock_timestamp())
        AS expired,
    coalesce(array_agg(DISTINCT worker_id) FILTER (
        WHERE status = 'running' AND lease_expires_at > clock_timestamp()), '{}') AS workers
FROM agent_run
WHERE status IN ('queued', 'running');

-- server_version --
-- Reported by doctor; agentd needs PostgreSQL 15 or newer.
SHOW server_version;

-- transcript_for_run --
-- What the model sees for a turn: every earlier turn (question, tool steps, answer) and its own
-- question, in turn order; minus turns not yet run (queued), handed back (draft), or replaced
-- by a retry or an edit (superseded).
SELECT m.role, m.content, m.tool_calls, m.tool_call_id
FROM message m
LEFT JOIN agent_run r ON r.id = m.run_id
LEFT JOIN message asked ON asked.id = r.user_message_id
WHERE m.conversation_id = $1::uuid
  AND coalesce(asked.position, m.position) <= (SELECT position FROM message WHERE id = $2::uuid)
  AND m.status NOT IN ('queued', 'draft') AND m.superseded_by IS NULL
ORDER BY coalesce(asked.position, m.position), m.position;

-- presence_attach --
-- An open conversation stream registers its device; the row lives only while renewed.
WITH attached AS (
    INSERT INTO presence (account_id, conversation_id, device_id, expires_at)
    VALUES ($1::uuid, $2::uuid, $3::uuid, clock_timestamp() + make_interval(secs => $4::float8))
    RETURNING id, conversation_id
)
SELECT attached.id, pg_notify('agentd_conversation', attached.conversation_id::text)
FROM attached;

-- presence_renew --
-- Keeps a stream's presence alive; zero rows means it expired (the stream re-attaches).
UPDATE presence SET expires_at = clock_timestamp() + make_interval(secs => $2::float8)
WHERE id = $1::uuid AND expires_at > clock_timestamp()
RETURNING id;

-- presence_detach --
-- The stream ended: the device is no longer attached (and the feeds hear it at once).
WITH gone AS (
    DELETE FROM presence WHERE id = $1::uuid RETURNING conversation_id
)
SELECT pg_notify('agentd_conversation', gone.conversation_id::text) FROM gone;

-- list_attached --
-- Attached devices of a conversation, by the database clock; a device with two streams counts
-- once, attached since its earliest.
SELECT d.id AS device_id, d.name AS device, min(p.since) AS since
FROM presence p JOIN device d ON d.id = p.device_id
WHERE p.conversation_id = $1::uuid AND p.expires_at > clock_timestamp()
GROUP BY d.id, d.name
ORDER BY min(p.since), d.name;

-- purge_expired_presence --
-- Rows of streams whose server died without detaching; cosmetic, the reads filter them anyway.
DELETE FROM presence WHERE expires_at < clock_timestamp() - interval '1 minute';

-- lock_conversation --
-- Serializes run creation and stops per conversation (enqueue's UPDATE takes the same lock):
-- two `reject` requests cannot both see it idle, and a stop sweeps every turn committed before
-- it. NO KEY UPDATE, not UPDATE: claims and finishes insert rows referencing the conversation
-- (KEY SHARE locks) while holding run locks a stop waits for; FOR UPDATE would deadlock them.
SELECT id FROM conversation WHERE id = $1::uuid AND account_id = $2::uuid FOR NO KEY UPDATE;

-- list_runs_of_conversation_since --
-- A conversation feed's discovery of runs: those after its watermark, plus the ones it still
-- follows, in run order; cancel_requested lets every device see a stop before the run ends.
SELECT id, status, created_at, cancel_requested
FROM agent_run
WHERE conversation_id = $1::uuid
  AND ((created_at, id) > ($2::timestamptz, $3::uuid) OR id = ANY ($4::uuid[]))
ORDER BY created_at, id;

-- update_conversation --
-- Rename, set the model, archive or restore; only the owning account, only what the request
-- names ($4 and $6 say whether model and archived were given: NULL is a model). Archiving is
-- not activity, so it leaves updated_at (the list's order) alone. The feeds hear of it.
-- params: conversation_id, account_id, title, set_model, model, archived
WITH changed AS (
    UPDATE conversation
    SET title = coalesce($3::text, title),
        model = CASE WHEN $4::bool THEN $5::text ELSE model END,
        archived_at = CASE WHEN $6::bool IS NULL THEN archived_at
                           WHEN $6::bool THEN coalesce(archived_at, clock_timestamp())
                           END,
        updated_at = CASE WHEN $3::text IS NOT NULL OR $4::bool THEN clock_timestamp()
                          ELSE updated_at END
    WHERE id = $1::uuid AND account_id = $2::uuid
    RETURNING id, account_id, title, model, archived_at, created_at, updated_at
)
SELECT changed.*, pg_notify('agentd_conversation', changed.id::text)
FROM changed;

-- latest_run_of_conversation --
-- A feed's starting watermark: runs after it are new to the feed.
SELECT created_at, id FROM agent_run
WHERE conversation_id = $1::uuid
ORDER BY created_at DESC, id DESC
LIMIT 1;

-- run_status --
-- A tail's truth check when the journal is quiet: a terminal run without a journaled
-- `complete` gets one synthesized from this row.
SELECT status, error FROM agent_run WHERE id = $1::uuid;

-- search_messages --
-- Search across one account's conversations (titles and transcripts); scoped by account first.
-- The pattern is a bound parameter; LIKE metacharacters in it are escaped by the caller.
SELECT c.id AS conversation_id, c.title, m.id AS message_id, m.role, m.content, m.created_at
FROM message m
JOIN conversation c ON c.id = m.conversation_id
WHERE c.account_id = $1::uuid AND m.status <> 'draft'
  AND (m.content ILIKE $2::text ESCAPE '\' OR c.title ILIKE $2::text ESCAPE '\')
ORDER BY m.created_at DESC
LIMIT $3::int;

-- append_note_fenced --
-- Seed 000, downstream fencing: the notebook raises its per-conversation high-water mark and
-- appends in ONE statement; a fence lower than the mark (a superseded execution) updates and
-- inserts nothing (zero rows = rejected). The conflicting mark row is locked and re-checked, so
-- concurrent writers serialize on it and an older fence can never slip in after a newer one.
-- The writing run's row is locked first, as every worker write and a conversation's delete take
-- it: a delete holding it is waited for (and then nothing is written), never deadlocked with.
WITH writer AS (
    SELECT id FROM agent_run WHERE id = $3::uuid FOR KEY SHARE
), mark AS (
    INSERT INTO conversation_note_fence (conversation_id, fence, run_id)
    SELECT $1::uuid, $2::bigint, writer.id FROM writer
    ON CONFLICT (conversation_id) DO UPDATE
        SET fence = EXCLUDED.fence, run_id = EXCLUDED.run_id, updated_at = clock_timestamp()
        WHERE conversation_note_fence.fence <= EXCLUDED.fence
    RETURNING fence
)
INSERT INTO conversation_note (conversation_id, run_id, fence, text)
SELECT $1::uuid, $3::uuid, mark.fence, $4::text FROM mark
RETURNING id, created_at;

-- note_fence_mark --
-- The highest fence the notebook has seen for a conversation (what a rejection reports).
SELECT fence FROM conversation_note_fence WHERE conversation_id = $1::uuid;

-- list_notes --
-- A conversation's notes in the order written; the most recent $2 of them.
SELECT id, text, run_id, created_at FROM (
    SELECT id, text, run_id, created_at FROM conversation_note
    WHERE conversation_id = $1::uuid
    ORDER BY id DESC
    LIMIT $2::int
) AS latest
ORDER BY id;

-- notify_batch --
-- Wake hints for rows already committed, many per statement (rule 6: hints, not truth). A
-- notify-only transaction assigns no xid, so it commits without a WAL flush.
SELECT count(pg_notify(t.channel, t.payload))
FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS t (channel, payload, n);

-- conversation_meta --
-- Rule 9 and a feed's re-read: the conversation (zero rows: not yours, or deleted, which ends
-- every feed of it), the messages a retry or an edit superseded (each with the user message
-- that replaced it), and the token totals of its runs.
-- params: conversation_id, account_id
SELECT c.id, c.account_id, c.title, c.model, c.archived_at, c.created_at, c.updated_at,
       (SELECT coalesce(jsonb_object_agg(m.id, m.superseded_by), '{}'::jsonb)
        FROM message m
        WHERE m.conversation_id = c.id AND m.superseded_by IS NOT NULL) AS superseded,
       (SELECT jsonb_build_object(
                   'input_tokens', coalesce(sum((r.usage ->> 'input_tokens')::bigint), 0),
                   'output_tokens', coalesce(sum((r.usage ->> 'output_tokens')::bigint), 0),
                   'runs', count(*))
        FROM agent_run r
        WHERE r.conversation_id = c.id AND r.usage IS NOT NULL) AS usage
FROM conversation c
WHERE c.id = $1::uuid AND c.account_id = $2::uuid;

-- conversation_run_usage --
-- The model and token counts of each run of a conversation that reported usage, shown beside
-- the answer it produced.
-- params: conversation_id
SELECT id, request ->> 'model' AS model, usage
FROM agent_run
WHERE conversation_id = $1::uuid AND usage IS NOT NULL;

-- delete_conversation --
-- One statement removes a conversation and, by ON DELETE CASCADE, its runs, journal, leases,
-- presence, notes and messages. Runs after the stop sweep locked its active runs in the same
-- transaction (lock_conversation first, so no turn is enqueued or claimed half-way). Wakes the
-- feeds (they see it gone and end) and the tails of its running turn; the worker still running
-- it finds no row at its next fenced write (LeaseLost) and stops.
-- params: conversation_id, account_id
WITH running AS (
    SELECT r.id FROM agent_run r
    WHERE r.conversation_id = $1::uuid AND r.account_id = $2::uuid AND r.status = 'running'
), gone AS (
    DELETE FROM conversation WHERE id = $1::uuid AND account_id = $2::uuid
    RETURNING id
)
SELECT gone.id, pg_notify('agentd_conversation', gone.id::text),
       (SELECT count(pg_notify('agentd_run_event', running.id::text)) FROM running) AS woken
FROM gone;

-- fork_conversation --
-- A new conversation holding a copy of the transcript up to and including message $3, in one
-- statement that only reads the original. Only what has ended is copied: never a queued or
-- draft message nor a row of a turn still queued or running (so a fork works while a turn
-- runs); the results of a copied tool call come along, so a call and its result never split.
-- A superseded mark is kept only if the message that replaced it is copied too. Zero rows: no
-- such conversation; message_found false: no such message in it; id NULL: that message cannot
-- be forked from (its turn has not ended, or it is a draft).
-- params: conversation_id, account_id, message_id
WITH source AS (
    SELECT id, account_id, title, model FROM conversation
    WHERE id = $1::uuid AND account_id = $2::uuid
), eligible AS (
    SELECT m.id, m.role, m.content, m.status, m.tool_calls, m.tool_call_id, m.created_at,
           m.superseded_by, m.position, coalesce(asked.position, m.position) AS turn_position
    FROM message m
    JOIN source ON source.id = m.conversation_id
    LEFT JOIN agent_run r ON r.id = m.run_id
    LEFT JOIN message asked ON asked.id = r.user_message_id
    WHERE m.status NOT IN ('queued', 'draft')
      AND (r.id IS NULL OR r.status NOT IN ('queued', 'running'))
), target AS (
    SELECT turn_position, position FROM eligible WHERE id = $3::uuid
), upto AS (
    SELECT e.* FROM eligible e, target t
    WHERE (e.turn_position, e.position) <= (t.turn_position, t.position)
), picked AS (
    SELECT * FROM upto
    UNION ALL
    SELECT e.* FROM eligible e, target t
    WHERE e.role = 'tool' AND (e.turn_position, e.position) > (t.turn_position, t.position)
      AND EXISTS (SELECT 1 FROM upto call
                  WHERE call.role = 'assistant' AND call.turn_position = e.turn_position
                    AND call.tool_calls @> jsonb_build_array(
                        jsonb_build_object('id', e.tool_call_id)))
), created AS (
    INSERT INTO conversation (account_id, title, model)
    SELECT source.account_id,
           left(CASE WHEN source.title = '' THEN 'Fork' ELSE source.title || ' (fork)' END, 500),
           source.model
    FROM source
    WHERE EXISTS (SELECT 1 FROM target)
    RETURNING id, account_id, title, model, archived_at, created_at, updated_at
), mapped AS (
    SELECT picked.*, gen_random_uuid() AS copy_id FROM picked
), copied AS (
    -- in turn order, so the copies' positions (their only order: they belong to no run) keep it
    INSERT INTO message (id, conversation_id, role, content, status, tool_calls, tool_call_id,
                         created_at, superseded_by)
    SELECT m.copy_id, created.id, m.role, m.content, m.status, m.tool_calls, m.tool_call_id,
           m.created_at, (SELECT r.copy_id FROM mapped r WHERE r.id = m.superseded_by)
    FROM mapped m CROSS JOIN created
    ORDER BY m.turn_position, m.position
    RETURNING id
)
SELECT created.*,
       EXISTS (SELECT 1 FROM message WHERE id = $3::uuid AND conversation_id = source.id)
           AS message_found,
       (SELECT count(*) FROM copied) AS copied
FROM source LEFT JOIN created ON true;

-- retry_target --
-- Read under lock_conversation before a retry or an edit: the conversation's latest turn (its
-- last user message that is neither a draft nor superseded) and its run's status, and message
-- $2 (NULL: that latest one) with its run's request. Only the latest turn, once ended, can be
-- re-run: the caller turns these columns into the 404 or 409 that says why not.
-- params: conversation_id, message_id
WITH latest AS (
    SELECT m.id, m.status, r.status AS run_status
    FROM message m
    LEFT JOIN agent_run r ON r.id = m.run_id
    WHERE m.conversation_id = $1::uuid AND m.role = 'user' AND m.status <> 'draft'
      AND m.superseded_by IS NULL
    ORDER BY m.position DESC
    LIMIT 1
)
SELECT latest.id AS latest_id, latest.status AS latest_status,
       latest.run_status AS latest_run_status,
       t.id, t.role, t.content, t.status, t.superseded_by, r.request
FROM (SELECT 1) AS one
LEFT JOIN latest ON true
LEFT JOIN message t ON t.id = coalesce($2::uuid, latest.id) AND t.conversation_id = $1::uuid
LEFT JOIN agent_run r ON r.id = t.run_id;

-- supersede_exchange --
-- A retry or an edit replaced the latest turn: its user message $2 and everything after it in
-- turn order (tool steps, the answer) are marked with the new user message $3, in the
-- transaction that enqueued the new turn, under lock_conversation. Drafts are no exchange's.
-- params: conversation_id, message_id, superseded_by
WITH cut AS (
    SELECT coalesce(asked.position, t.position) AS turn_position
    FROM message t
    LEFT JOIN agent_run r ON r.id = t.run_id
    LEFT JOIN message asked ON asked.id = r.user_message_id
    WHERE t.id = $2::uuid AND t.conversation_id = $1::uuid
), exchange AS (
    SELECT m.id
    FROM message m
    LEFT JOIN agent_run r ON r.id = m.run_id
    LEFT JOIN message asked ON asked.id = r.user_message_id
    CROSS JOIN cut
    WHERE m.conversation_id = $1::uuid AND m.superseded_by IS NULL AND m.status <> 'draft'
      AND m.id <> $3::uuid AND coalesce(asked.position, m.position) >= cut.turn_position
)
UPDATE message m SET superseded_by = $3::uuid
FROM exchange
WHERE m.id = exchange.id
RETURNING m.id;
