-- Every statement agentd sends, by name. Bound parameters only; no SQL is built from input.
-- Format: a "-- name --" line; a "-- params: a, b" line naming $1, $2, … in order (left out when
-- the statement takes none); comment lines naming the invariant it protects; the statement.
-- Callers bind by name: db.fetchrow(*Q.check_lease.bind(run_id=…, claim_token=…)).
-- All lease comparisons use clock_timestamp() (the database clock, sampled once per statement).
-- "Rule N" is rule N of docs/architecture.md ("The rules and where they live").

-- enqueue_runs --
-- params: account_id, conversation_ids, device_id, contents, requests, request_hashes, idempotency_keys, default_max_queued
-- A run is a row (docs/architecture.md rule 1): for each turn, the user message, the run,
-- journal seq 1-2 and the wake commit in ONE statement, with every other turn of the call,
-- within the account's queued limit, a repeated idempotency key inserting nothing; one answer
-- row per turn, in order (the enqueue_runs function, sql/019, says how).
SELECT * FROM enqueue_runs($1::uuid, $2::uuid[], $3::uuid, $4::text[], $5::text[], $6::text[],
                           $7::text[], $8::int, true);

-- post_turn --
-- params: account_id, conversation_id, device_id, content, request, request_hash, idempotency_key, default_max_queued, worker_id, lease_ttl_s, default_max_running, model_guessed, guessed_model, claim_key
-- A client's post: one turn in ONE statement (sql/019, sql/021) that writes nothing at all when
-- it refuses the turn or when the conversation's model is no longer the one the request was
-- built for (model_guessed). With a worker_id (a free slot of the posting process) the turn
-- starts in that commit when the fair claim can only pick it (written running at once into an
-- empty line, else claimed beside its enqueue: sql/015), else it stays queued and the claim
-- loops are woken; the enqueue never fails for the claim. The claim's token comes from
-- claim_key, as claim_runs' does.
SELECT * FROM post_turn($1::uuid, $2::uuid, $3::uuid, $4::text, $5::text, $6::text, $7::text,
                        $8::int, $9::text, $10::float8, $11::int, $12::boolean, $13::text,
                        $14::uuid);

-- find_run_by_idempotency_key --
-- params: account_id, idempotency_key
-- The first run minted for a key, so a retried POST answers with it instead of a second run.
SELECT id, status, conversation_id, request_hash
FROM agent_run
WHERE account_id = $1::uuid AND idempotency_key = $2::text;

-- claim_runs --
-- params: worker_id, lease_ttl_s, limit, default_max_running, claim_key
-- Claim in one statement (docs/architecture.md rule 2): the claim_runs function (sql/011) picks
-- with SKIP LOCKED, fairly across accounts (round robin) and FIFO within each, only a
-- conversation's oldest queued turn and none while it runs one (rule 5: the pre-filter can be
-- fooled by snapshots, the one_running_per_conversation index cannot), within each account's
-- running limit (numbered running slots, each taken with a try-lock that never waits: sql/011),
-- passing by accounts whose queued turns all wait behind running ones (sql/026); stamps a fresh
-- claim_token, a monotonic fence and a deadline on the database clock, takes the conversation
-- lease (a live holder aborts the whole claim: no half claim can commit) and journals
-- run_started; last_seq is that event's seq. Each run's token comes from claim_key, so a claim
-- whose answer is lost is found again (runs_claimed_with_key).
SELECT * FROM claim_runs($1::text, $2::float8, $3::int, $4::int, $5::uuid);

-- runs_claimed_with_key --
-- params: worker_id, claim_key
-- The runs a claim statement with this key committed that are still running under this worker
-- (sql/023): what a claimer whose answer was lost holds. Only the claim's own token matches, so
-- no run is taken twice, and a run ended meanwhile (stopped, reaped) is not taken at all.
SELECT r.id, r.account_id, r.conversation_id, r.user_message_id, r.origin_device_id, r.request,
       r.claim_token, r.fence, r.worker_id, r.lease_expires_at, r.cancel_requested,
       r.created_at, r.started_at,
       (SELECT max(e.seq) FROM run_event e WHERE e.run_id = r.id) AS last_seq
FROM agent_run r
WHERE r.status = 'running' AND r.worker_id = $1::text
  AND r.claim_token = claim_token_for($2::uuid, r.id)
ORDER BY r.started_at, r.id;

-- beat --
-- params: worker_id, host, pid, listen, version, lease_ttl_s, runs_in_flight, max_runs, loop_lag_ms, pool_wait_ms, admitting, run_ids, claim_tokens
-- One beat per process (docs/architecture.md rule 3): renews the lease of every run the process
-- holds and its own worker row, in ONE statement, sent on a connection reserved for it so no
-- load on the pool can delay it. Each run is fenced by its own claim token, status running and a
-- deadline still ahead of clock_timestamp() when its row is locked, so a late beat can never
-- revive an expired lease. The beat's moment is statement_timestamp() (the database clock when
-- the statement arrived, before any check): the new deadline counts from it, never longer than
-- granted, and last_heartbeat_at is earlier than every check it passed.
-- Rows locked by someone else are skipped, never waited for: one run held by a slow or frozen
-- transaction cannot hold up the renewal of all the others. Per run the outcome is `renewed`,
-- `busy` (locked elsewhere but, as last committed, still ours: renew_leases_waiting retries it
-- at once) or `lost` (its token, status or deadline says it is no longer ours: stop, write
-- nothing more). Returns the cancel flags: the beat is also the missed-NOTIFY poll (rule 8).
-- The worker row (what `agentd status` lists) lives one lease past its last beat.
WITH clock AS (
    SELECT statement_timestamp() AS now
), me AS (
    INSERT INTO worker AS w (id, host, pid, listen, version, last_beat_at, expires_at,
                             runs_in_flight, max_runs, loop_lag_ms, pool_wait_ms, admitting)
    SELECT $1::text, $2::text, $3::int, $4::text, $5::text, clock.now,
           clock.now + make_interval(secs => $6::float8), $7::int, $8::int, $9::float8,
           $10::float8, $11::bool
    FROM clock
    ON CONFLICT (id) DO UPDATE
    SET last_beat_at = EXCLUDED.last_beat_at, expires_at = EXCLUDED.expires_at,
        runs_in_flight = EXCLUDED.runs_in_flight, max_runs = EXCLUDED.max_runs,
        loop_lag_ms = EXCLUDED.loop_lag_ms, pool_wait_ms = EXCLUDED.pool_wait_ms,
        admitting = EXCLUDED.admitting, listen = EXCLUDED.listen
), held AS (
    SELECT h.run_id, h.claim_token
    FROM unnest($12::uuid[], $13::uuid[]) AS h (run_id, claim_token)
), mine AS (
    SELECT r.id
    FROM agent_run r JOIN held ON held.run_id = r.id AND held.claim_token = r.claim_token
    WHERE r.status = 'running' AND r.lease_expires_at > clock_timestamp()
    FOR NO KEY UPDATE OF r SKIP LOCKED
), renewed AS (
    UPDATE agent_run r
    SET lease_expires_at = clock.now + make_interval(secs => $6::float8),
        last_heartbeat_at = clock.now
    FROM mine, clock
    WHERE r.id = mine.id AND r.status = 'running' AND r.lease_expires_at > clock_timestamp()
    RETURNING r.id, r.cancel_requested, r.lease_expires_at
)
SELECT held.run_id,
       CASE WHEN renewed.id IS NOT NULL THEN 'renewed'
            WHEN EXISTS (SELECT 1 FROM agent_run r
                         WHERE r.id = held.run_id AND r.claim_token = held.claim_token
                           AND r.status = 'running' AND r.lease_expires_at > clock_timestamp())
                THEN 'busy'
            ELSE 'lost' END AS outcome,
       renewed.cancel_requested, renewed.lease_expires_at
FROM held LEFT JOIN renewed ON renewed.id = held.run_id;

-- renew_leases_waiting --
-- params: lease_ttl_s, run_ids, claim_tokens
-- The beat's second chance for the few runs it found locked (mid-append, mid-stop): the same
-- fenced renewal, waiting for the row locks this time (bounded by the beat connection's
-- lock_timeout). A run missing from the result was re-checked after its lock: it is lost.
-- Clocks as in beat: checked against clock_timestamp(), renewed from statement_timestamp().
UPDATE agent_run r
SET lease_expires_at = clock.now + make_interval(secs => $1::float8),
    last_heartbeat_at = clock.now
FROM unnest($2::uuid[], $3::uuid[]) AS held (run_id, claim_token),
     (SELECT statement_timestamp() AS now) clock
WHERE r.id = held.run_id AND r.claim_token = held.claim_token AND r.status = 'running'
  AND r.lease_expires_at > clock_timestamp()
RETURNING r.id AS run_id, r.cancel_requested, r.lease_expires_at;

-- retire_worker --
-- params: worker_id
-- A process that drained and exits leaves the fleet at once (a crashed one expires instead).
DELETE FROM worker WHERE id = $1::text;

-- purge_dead_workers --
-- params: older_than_s
-- Rows of processes that stopped beating long ago; `agentd status` shows live ones anyway.
DELETE FROM worker WHERE expires_at < clock_timestamp() - make_interval(secs => $1::float8);

-- list_workers --
-- Every process of the fleet that beat recently, live ones (deadline ahead) first; `live` and
-- `beat_age_s` by the database clock.
SELECT w.id, w.host, w.pid, w.listen, w.version, w.started_at, w.last_beat_at, w.expires_at,
       w.runs_in_flight, w.max_runs, w.loop_lag_ms, w.pool_wait_ms, w.admitting,
       w.expires_at > clock_timestamp() AS live,
       extract(epoch FROM clock_timestamp() - w.last_beat_at)::float8 AS beat_age_s
FROM worker w
ORDER BY (w.expires_at > clock_timestamp()) DESC, w.host, w.pid, w.id;

-- check_lease --
-- params: run_id, claim_token
-- Before a turn's first write, the granted deadline must still be ahead (database clock) and
-- the claim still ours; zero rows = LeaseLost. Read-only, so no synchronous commit
-- delays the start (the claim has just granted a full lease). Also reads the cancel flag after
-- the worker subscribed to stop hints, so a stop that landed in between is not missed.
SELECT cancel_requested, lease_expires_at
FROM agent_run
WHERE id = $1::uuid AND claim_token = $2::uuid AND status = 'running'
  AND lease_expires_at > clock_timestamp();

-- open_turn --
-- params: run_id, claim_token, conversation_id, user_message_id
-- A turn's first read, in one round trip: the check that the granted deadline is still ahead
-- (database clock) and the claim still ours, as check_lease, and what the model sees
-- (turn_transcript, sql/011), a row per message with the lease columns repeated. Zero rows =
-- LeaseLost: the transcript always holds the turn's own question.
SELECT lease.cancel_requested, lease.lease_expires_at,
       t.role, t.content, t.tool_calls, t.tool_call_id
FROM (SELECT r.cancel_requested, r.lease_expires_at
      FROM agent_run r
      WHERE r.id = $1::uuid AND r.claim_token = $2::uuid AND r.status = 'running'
        AND r.lease_expires_at > clock_timestamp()) lease
CROSS JOIN LATERAL turn_transcript($3::uuid, $4::uuid) WITH ORDINALITY AS t
ORDER BY t.ordinality;

-- append_events_fenced --
-- params: run_id, claim_token, seqs, types, payloads
-- Streams are tables (docs/architecture.md rule 7): a worker's journal batch lands whole or not
-- at all, only while it owns the run.
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

-- append_events_fenced_many --
-- params: run_ids, claim_tokens, seqs, types, payloads
-- Group commit (group_commit.py): the journal batches of many runs in ONE statement and one
-- commit, one row per event (its run and claim token repeated). Each run is fenced on its own
-- exactly as append_events_fenced fences one: only rows of runs still owned are written, under
-- FOR SHARE (taken in id order); a run missing from the result, or short of its count, was
-- refused (LeaseLost) while the others landed. A seq someone else took (unique violation), a
-- value PostgreSQL refuses in one run's rows, or one run's row held past lock_timeout, fails
-- the whole statement: the caller then writes each batch alone, so that only that run gets the
-- error.
-- Answers the rows written (their stamps too: the writer hands them to its own tails).
WITH e AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::bigint[], $4::text[], $5::text[])
        AS e (run_id, claim_token, seq, type, payload)
), owners AS (
    SELECT r.id
    FROM agent_run r
    JOIN (SELECT DISTINCT run_id, claim_token FROM e) asked
      ON asked.run_id = r.id AND asked.claim_token = r.claim_token
    WHERE r.status = 'running' AND r.lease_expires_at > clock_timestamp()
    ORDER BY r.id
    FOR SHARE OF r
), written AS (
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT e.run_id, e.seq, e.type, e.payload::jsonb
    FROM e JOIN owners ON owners.id = e.run_id
    RETURNING run_id, seq, created_at
)
SELECT run_id, seq, created_at FROM written;

-- insert_message_fenced --
-- params: run_id, claim_token, role, content, status, tool_calls, tool_call_id, message_id
-- A worker's transcript write (assistant tool-call turns, tool results) lands only while it
-- owns the run; a zombie writes zero rows. The id is the caller's, so a retry after a lost
-- answer finds the row its first attempt wrote instead of writing a second one.
WITH owner AS (
    SELECT id, conversation_id FROM agent_run
    WHERE id = $1::uuid AND claim_token = $2::uuid AND status = 'running'
      AND lease_expires_at > clock_timestamp()
    FOR SHARE
), written AS (
    INSERT INTO message (id, conversation_id, run_id, role, content, status, tool_calls,
                         tool_call_id)
    SELECT $8::uuid, owner.conversation_id, owner.id, $3::text, $4::text, $5::text, $6::jsonb,
           $7::text
    FROM owner
    ON CONFLICT (id) DO NOTHING
    RETURNING id
)
SELECT id FROM written
UNION ALL
SELECT m.id FROM message m JOIN owner ON owner.id = m.run_id WHERE m.id = $8::uuid;

-- answer_open_tool_calls_fenced --
-- params: run_id, claim_token
-- A stopped or failed turn answers the tool calls it leaves open with `cancelled` results
-- (answer_open_tool_calls, sql/004) before its terminal write, only while it owns the run:
-- zero rows = LeaseLost. FOR SHARE serializes with the reaper, as insert_message_fenced does.
WITH owner AS (
    SELECT id FROM agent_run
    WHERE id = $1::uuid AND claim_token = $2::uuid AND status = 'running'
      AND lease_expires_at > clock_timestamp()
    FOR SHARE
)
SELECT answer_open_tool_calls(owner.id) AS answered
FROM owner;

-- finish_runs --
-- params: run_ids, claim_tokens, statuses, errors, error_codes, usages, contents, message_statuses, seqs, event_run_ids, event_seqs, event_types, event_payloads
-- The workers' terminal writes (docs/architecture.md rule 3), one or many runs in one
-- statement (finish_runs, sql/011): each fenced on its own (claim token, status running,
-- deadline ahead); terminal states are sticky. Per run: its last journal batch, the repair of
-- open tool calls, the answer message (a `failed` run's is its journal's text), the one
-- 'complete' event and the lease release; a run missing from the answer was refused. The
-- caller sends the knock that starts the next turn right after the commit.
SELECT * FROM finish_runs($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::text[],
                          $6::text[], $7::text[], $8::text[], $9::bigint[], $10::uuid[],
                          $11::bigint[], $12::text[], $13::text[]);

-- reap_expired_runs --
-- params: grace_s, limit
-- Expiry, at most once (docs/architecture.md rules 3-4): finalize 'failed' only runs whose
-- deadline has passed, re-checked inside this write against the row as it is now (a heartbeat
-- that landed first wins; SKIP LOCKED passes over a run whose heartbeat is in flight). Never
-- re-queued: at most once.
-- The caller journals the ending with journal_endings in the same transaction. What clients
-- see is the code and a message without internals; the worker's id goes to the reaper's log.
UPDATE agent_run r
SET status = 'failed',
    error = 'the worker running this turn stopped renewing its lease',
    error_code = 'lease_expired',
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
RETURNING r.id, r.account_id, r.conversation_id, r.claim_token, r.status, r.error,
          r.error_code, r.worker_id, r.started_at, r.finished_at;

-- journal_endings --
-- params: run_ids, account_ids, conversation_ids, claim_tokens, statuses, errors, draft_ids, error_codes
-- Finalizers other than the worker (reaper, stop) append 'complete' at max(seq)+1. Run as its
-- own statement AFTER the fencing UPDATE in the same transaction: READ COMMITTED gives it a
-- fresh snapshot that sees every append committed before our row lock, and the lock holds off
-- the rest. one_complete_per_run makes a second ending impossible regardless.
-- Releases the runs' leases by execution id, answers the tool calls a dead worker left open
-- (answer_open_tool_calls, sql/004) and knocks the queue. A run ended `failed` keeps the text
-- its journal holds (journal_text, sql/008) as its answer with status `failed`, written after
-- the repair (it reads from it), so the transcript stays in turn order and equals what every
-- client saw. A turn a stop cancelled before it started names its handed-back draft, so every
-- stream can return it to its author.
WITH ended AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::text[],
                         $6::text[], $7::uuid[], $8::text[])
        AS t (run_id, account_id, conversation_id, claim_token, status, error, draft_id,
              error_code)
), repaired AS (
    SELECT ended.*, answer_open_tool_calls(ended.run_id) AS repaired_calls FROM ended
), answer AS (
    INSERT INTO message (conversation_id, run_id, role, content, status)
    SELECT repaired.conversation_id, repaired.run_id, 'assistant', said.content, 'failed'
    FROM repaired, LATERAL (SELECT nullif(journal_text(repaired.run_id), '') AS content) said
    WHERE repaired.status = 'failed' AND said.content IS NOT NULL
    RETURNING id, run_id
), journal AS (
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT repaired.run_id,
           coalesce((SELECT max(e.seq) FROM run_event e WHERE e.run_id = repaired.run_id), 0)
           + 1,
           'complete',
           jsonb_build_object('status', repaired.status, 'error', repaired.error,
                              'error_code', repaired.error_code, 'message_id', answer.id)
           || CASE WHEN repaired.draft_id IS NULL THEN '{}'::jsonb
                   ELSE jsonb_build_object('draft', jsonb_build_object(
                       'message_id', repaired.draft_id,
                       'content', (SELECT content FROM message WHERE id = repaired.draft_id)))
              END
    FROM repaired LEFT JOIN answer ON answer.run_id = repaired.run_id
), released AS (
    DELETE FROM conversation_lease l
    USING ended
    WHERE l.account_id = ended.account_id AND l.conversation_id = ended.conversation_id
      AND l.execution_id = ended.claim_token
)
SELECT repaired.run_id, repaired.repaired_calls, answer.id AS message_id,
       pg_notify('agentd_run_event', repaired.run_id::text),
       pg_notify('agentd_run_enqueued', repaired.conversation_id::text),
       pg_notify('agentd_conversation', repaired.conversation_id::text)
FROM repaired LEFT JOIN answer ON answer.run_id = repaired.run_id;

-- release_lease --
-- params: account_id, conversation_id, execution_id
-- Release the conversation lease only by execution id. If A expired and B took over, A's late
-- cleanup matches zero rows and B's lease survives; zero rows is a normal, idempotent outcome.
DELETE FROM conversation_lease
WHERE account_id = $1::uuid AND conversation_id = $2::uuid AND execution_id = $3::uuid
RETURNING run_id;

-- lock_active_runs --
-- params: conversation_id, account_id
-- Stop is one transaction (docs/architecture.md rule 8): the sweep locks every active run of
-- the conversation, queued and running, in ONE transaction, so no claim or terminal wake can
-- start a turn in the middle of it.
-- Both states as OR, not IN: PostgreSQL answers that from their partial indexes (sql/017).
SELECT id, status
FROM agent_run
WHERE conversation_id = $1::uuid AND account_id = $2::uuid
  AND (status = 'queued' OR status = 'running')
ORDER BY created_at, id
FOR UPDATE;

-- cancel_queued_runs --
-- params: run_ids
-- A queued turn never started: cancel it outright and hand its text back as a draft.
-- Runs only under lock_active_runs' locks; status = 'queued' re-checked in the write.
-- Drafts come back in the order their turns were queued.
WITH cancelled AS (
    UPDATE agent_run r
    SET status = 'cancelled', error = 'stopped before it started',
        error_code = 'stopped_before_start', finished_at = clock_timestamp()
    WHERE r.id = ANY ($1::uuid[]) AND r.status = 'queued'
    RETURNING r.id, r.account_id, r.conversation_id, r.claim_token, r.status, r.error,
              r.error_code, r.user_message_id, r.created_at
), drafts AS (
    UPDATE message m SET status = 'draft'
    FROM cancelled
    WHERE m.id = cancelled.user_message_id
    RETURNING m.id, m.run_id, m.content
)
SELECT c.id, c.account_id, c.conversation_id, c.claim_token, c.status, c.error, c.error_code,
       d.id AS message_id, d.content
FROM cancelled c JOIN drafts d ON d.run_id = c.id
ORDER BY c.created_at, c.id;

-- request_cancel --
-- params: run_ids
-- Stop is a state (docs/architecture.md rule 8). Flag running runs; the NOTIFY is only the fast
-- path, the worker re-reads the flag on every heartbeat. Terminal runs are untouched (sticky).
UPDATE agent_run
SET cancel_requested = true
WHERE id = ANY ($1::uuid[]) AND status = 'running'
RETURNING id, pg_notify('agentd_run_cancel', id::text);

-- notify_conversation --
-- params: payload
-- Ownership or presence of a conversation changed: wake its feeds (they re-read rows).
SELECT pg_notify('agentd_conversation', $1::text);

-- read_events_after --
-- params: run_id, after_seq, limit
-- A tail is a cursor over the journal (docs/architecture.md rule 7); any process can serve it.
SELECT seq, type, payload, created_at
FROM run_event
WHERE run_id = $1::uuid AND seq > $2::bigint
ORDER BY seq
LIMIT $3::int;

-- read_events_after_many --
-- params: run_ids, after_seqs, limit
-- Many tails' reads in one round trip (shared_reads.py): for each (run, cursor) pair, numbered
-- by its position, the run's journal rows after that cursor, at most `limit` of them.
SELECT c.i, e.seq, e.type, e.payload, e.created_at
FROM unnest($1::uuid[], $2::bigint[]) WITH ORDINALITY AS c (run_id, after_seq, i)
CROSS JOIN LATERAL (
    SELECT seq, type, payload, created_at
    FROM run_event
    WHERE run_id = c.run_id AND seq > c.after_seq
    ORDER BY seq
    LIMIT $3::int
) e
ORDER BY c.i, e.seq;

-- get_run --
-- params: run_id, account_id
-- A run is visible only to its own account (docs/architecture.md rule 9). Names the device that
-- asked: the view agent_run_with_device (sql/004) is the one list of a run's columns.
SELECT * FROM agent_run_with_device
WHERE id = $1::uuid AND account_id = $2::uuid;

-- list_messages --
-- params: conversation_id
-- The durable transcript in turn order: each run's answer follows its own question, even when
-- later questions were queued (written) before it ran.
SELECT m.id, m.run_id, m.role, m.content, m.status, m.tool_calls, m.tool_call_id, m.created_at
FROM message m
LEFT JOIN agent_run r ON r.id = m.run_id
LEFT JOIN message asked ON asked.id = r.user_message_id
WHERE m.conversation_id = $1::uuid
ORDER BY coalesce(asked.position, m.position), m.position;

-- message_turn_position --
-- params: conversation_id, message_id
-- A paging cursor: where a message sits in its conversation's turn order (its question's
-- position), by the rule of the view message_turn (sql/024) for one row: a fork's copy that is
-- not a question belongs to the question written last before it. (The view would number the
-- whole conversation to answer for one message.) No row: not a message of this conversation.
SELECT coalesce(asked.position, copied.position, m.position) AS turn_position
FROM message m
LEFT JOIN agent_run r ON r.id = m.run_id
LEFT JOIN message asked ON asked.id = r.user_message_id
LEFT JOIN LATERAL (
    SELECT q.position FROM message q
    WHERE m.run_id IS NULL AND m.role <> 'user' AND q.conversation_id = m.conversation_id
      AND q.role = 'user' AND q.position < m.position
    ORDER BY q.position DESC
    LIMIT 1
) copied ON true
WHERE m.id = $2::uuid AND m.conversation_id = $1::uuid;

-- list_message_ids --
-- params: conversation_id, account_id
-- The export's plan: the ids of the transcript in turn order (as list_messages), drafts left
-- out, read once; the messages themselves are then read a page at a time (messages_by_id), so
-- exporting a long conversation to a slow reader holds neither a pooled connection nor the
-- whole transcript in memory, and its work grows with its length, not with its square. Only
-- the account's own conversation (docs/architecture.md rule 9).
SELECT m.id
FROM message m
JOIN conversation c ON c.id = m.conversation_id AND c.account_id = $2::uuid
LEFT JOIN agent_run r ON r.id = m.run_id
LEFT JOIN message asked ON asked.id = r.user_message_id
WHERE m.conversation_id = $1::uuid AND m.status <> 'draft'
ORDER BY coalesce(asked.position, m.position), m.position;

-- messages_by_id --
-- params: conversation_id, ids
-- A page of the export's plan (list_message_ids), in any order: the caller puts it back in
-- the plan's. Fewer rows than ids: the conversation was deleted (or changed) meanwhile.
SELECT id, run_id, role, content, status, tool_calls, tool_call_id, created_at, superseded_by
FROM message
WHERE conversation_id = $1::uuid AND id = ANY ($2::uuid[]);

-- list_messages_page --
-- params: conversation_id, before_turn, limit, until_turn
-- One page of the transcript, pages newest first, each in turn order (as list_messages): the
-- $3 newest messages of turns before turn position $2, widened to whole turns (a page never
-- splits a turn) and, with $4, back to that turn (a jump loads everything down to its target).
-- has_more: older turns remain before the page.
WITH ordered AS (
    SELECT id, run_id, role, content, status, tool_calls, tool_call_id, created_at, position,
           turn_position
    FROM message_turn
    WHERE conversation_id = $1::uuid AND turn_position < $2::bigint
), newest AS (
    SELECT turn_position FROM ordered ORDER BY turn_position DESC, position DESC LIMIT $3::int
), start AS (
    SELECT least(min(turn_position), coalesce($4::bigint, min(turn_position))) AS turn_position
    FROM newest
)
SELECT o.id, o.run_id, o.role, o.content, o.status, o.tool_calls, o.tool_call_id, o.created_at,
       EXISTS (SELECT 1 FROM ordered WHERE turn_position < (SELECT turn_position FROM start))
           AS has_more
FROM ordered o
WHERE o.turn_position >= (SELECT turn_position FROM start)
ORDER BY o.turn_position, o.position;

-- list_active_runs --
-- params: conversation_id
-- The running turn and the queued ones behind it, in the order they will run.
-- Both states as OR, not IN: PostgreSQL answers that from their partial indexes (sql/017).
SELECT * FROM agent_run_with_device
WHERE conversation_id = $1::uuid AND (status = 'queued' OR status = 'running')
ORDER BY created_at, id;

-- young_tables_due --
-- params: tables, min_changes, grown_up_rows
-- Planner statistics while a hot table is young (statistics.py): the named tables that have
-- changed, since they were last analyzed, by at least min_changes rows and by as many rows as
-- they held then; past grown_up_rows rows autovacuum's own thresholds keep up.
SELECT s.relname::text AS name
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.schemaname = current_schema() AND s.relname = ANY ($1::text[])
  AND s.n_mod_since_analyze >= greatest($2::bigint, c.reltuples::bigint)
  AND c.reltuples < $3::float8;

-- try_statistics_lock --
-- One process of a fleet analyzes at a time (for the rest of its transaction); the others,
-- refused at once, leave it to that one instead of queueing behind it.
SELECT pg_try_advisory_xact_lock(hashtext('agentd.analyze_hot_tables'));

-- analyze_tables --
-- params: tables
-- Fresh statistics for the hot tables that are due (statistics.HOT_TABLES, sql/013); cached
-- plans that read them are made again with the new figures.
SELECT analyze_tables($1::text[]);

-- trim_journal --
-- params: older_than_s
-- Retention: the journal is a delivery buffer; the message table is the record. Trim events of
-- runs terminal for longer than the retention age, and the copy of the question in their
-- request (the message holds it): its model and params stay, for a retry and beside the answer.
WITH old AS (
    UPDATE agent_run SET request = request - 'content'
    WHERE status IN ('completed', 'failed', 'cancelled')
      AND finished_at < clock_timestamp() - make_interval(secs => $1::float8)
      AND (request ? 'content' OR EXISTS (SELECT 1 FROM run_event e WHERE e.run_id = id))
    RETURNING id
)
DELETE FROM run_event e USING old WHERE e.run_id = old.id;

-- ensure_account --
-- params: name
-- Accounts are named; creating one that exists returns it (token create is re-runnable).
INSERT INTO account (name) VALUES ($1::text)
ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name
RETURNING id, name, created_at;

-- create_device --
-- params: account_id, name, token_hash
-- A device credential; only the token's hash is stored (unique, so a hash names one device).
INSERT INTO device (account_id, name, token_hash)
VALUES ($1::uuid, $2::text, $3::bytea)
RETURNING id, account_id, name, created_at;

-- authenticate_device --
-- params: token_hash
-- Authorize first (docs/architecture.md rule 9): a bearer token resolves to (account, device)
-- only while not revoked; marks it seen. Brings the account's model patterns along (NULL: every
-- model), so an enqueue checks them without another round trip.
-- last_seen_at moves at most once a minute: writing it on every request put a synchronous
-- commit, and a row lock that all of a device's requests queue on, in front of every API call.
WITH found AS (
    SELECT d.id, d.name, d.account_id, a.name AS account_name, a.models
    FROM device d JOIN account a ON a.id = d.account_id
    WHERE d.token_hash = $1::bytea AND d.revoked_at IS NULL
), seen AS (
    UPDATE device d SET last_seen_at = clock_timestamp()
    FROM found
    WHERE d.id = found.id AND d.revoked_at IS NULL
      AND (d.last_seen_at IS NULL OR d.last_seen_at < clock_timestamp() - interval '1 minute')
)
SELECT found.id AS device_id, found.name AS device_name, found.account_id, found.account_name,
       found.models
FROM found;

-- set_account_limits --
-- params: name, change_running, max_running, change_queued, max_queued, change_models, models
-- An operator's limits for one account (created when missing). Each changes only when asked
-- ($2, $4, $6); NULL restores the fleet's default. Running turns are never touched: the next
-- claim and the next enqueue read the new limits (every daemon of the fleet alike). Every claim
-- loop is woken in the same commit: a raised running limit makes queued turns claimable that no
-- enqueue or ending announces.
WITH changed AS (
    INSERT INTO account AS acc (name, max_running, max_queued, models)
    VALUES ($1::text, CASE WHEN $2::bool THEN $3::int END, CASE WHEN $4::bool THEN $5::int END,
            CASE WHEN $6::bool THEN $7::text[] END)
    ON CONFLICT (name) DO UPDATE
    SET max_running = CASE WHEN $2::bool THEN EXCLUDED.max_running ELSE acc.max_running END,
        max_queued = CASE WHEN $4::bool THEN EXCLUDED.max_queued ELSE acc.max_queued END,
        models = CASE WHEN $6::bool THEN EXCLUDED.models ELSE acc.models END
    RETURNING id
)
SELECT changed.id, pg_notify('agentd_run_enqueued', 'limits') AS woken FROM changed;

-- list_account_limits --
-- params: name
-- Accounts with their limits (NULL: the fleet's default) and their queued and running turns
-- now; one account by name, or all when $1 is NULL.
SELECT a.id, a.name, a.max_running, a.max_queued, a.models,
       (SELECT count(*) FROM agent_run r WHERE r.account_id = a.id AND r.status = 'queued')
           AS queued,
       (SELECT count(*) FROM agent_run r WHERE r.account_id = a.id AND r.status = 'running')
           AS running,
       a.last_claimed_at
FROM account a
WHERE $1::text IS NULL OR a.name = $1::text
ORDER BY a.name;

-- queue_by_account --
-- params: limit
-- What `agentd status` and /metrics show per account: the busiest accounts' queued and running
-- turns, with their own limits (NULL: the fleet's default).
-- Both states as OR, not IN: PostgreSQL answers that from their partial indexes (sql/017).
SELECT a.name AS account, t.queued, t.running, a.max_running, a.max_queued
FROM (SELECT account_id, count(*) FILTER (WHERE status = 'queued') AS queued,
             count(*) FILTER (WHERE status = 'running') AS running
      FROM agent_run WHERE status = 'queued' OR status = 'running'
      GROUP BY account_id) t
JOIN account a ON a.id = t.account_id
ORDER BY t.queued + t.running DESC, a.name
LIMIT $1::int;

-- running_turns --
-- params: limit
-- Who owns which running conversation: the device that asked, the worker executing it and
-- the lease left by the database clock (negative: expired, awaiting the reaper).
SELECT r.id AS run_id, r.conversation_id, c.title, a.name AS account, d.name AS device,
       r.worker_id, r.started_at, r.cancel_requested,
       extract(epoch FROM r.lease_expires_at - clock_timestamp())::float8 AS lease_left_s
FROM agent_run r
JOIN conversation c ON c.id = r.conversation_id
JOIN account a ON a.id = r.account_id
LEFT JOIN device d ON d.id = r.origin_device_id
WHERE r.status = 'running'
ORDER BY r.started_at, r.id
LIMIT $1::int;

-- count_attached_devices --
-- Devices holding a conversation stream open anywhere in the fleet (each counted once).
SELECT count(DISTINCT device_id) FROM presence WHERE expires_at > clock_timestamp();

-- list_devices --
-- Operators see every credential, never a token.
SELECT d.id, a.name AS account, d.name, d.created_at, d.last_seen_at, d.revoked_at
FROM device d JOIN account a ON a.id = d.account_id
ORDER BY a.name, d.created_at;

-- revoke_device --
-- params: device_id, account_id
-- Revocation is a timestamp, so audit keeps the row; a revoked token authenticates nothing.
-- Its presence goes in the same commit and every feed hears it; the agentd_device hint tells
-- each process to end the device's open streams now (they also poll, so a lost hint only
-- delays that to the poll). account_id NULL: the operator, who may revoke any device.
WITH revoked AS (
    UPDATE device SET revoked_at = clock_timestamp()
    WHERE id = $1::uuid AND revoked_at IS NULL
      AND ($2::uuid IS NULL OR account_id = $2::uuid)
    RETURNING id, revoked_at
), gone AS (
    DELETE FROM presence p USING revoked WHERE p.device_id = revoked.id
    RETURNING p.conversation_id
)
SELECT revoked.revoked_at, pg_notify('agentd_device', revoked.id::text),
       (SELECT count(pg_notify('agentd_conversation', c.conversation_id::text))
        FROM (SELECT DISTINCT conversation_id FROM gone) c) AS feeds_told
FROM revoked;

-- device_revoked_at --
-- params: device_id, account_id
-- A revocation asked again (its first answer lost) is answered as the first one was: revoked_at
-- is set once and never cleared, so this read cannot race a revocation into a wrong answer.
SELECT revoked_at FROM device
WHERE id = $1::uuid AND revoked_at IS NOT NULL AND ($2::uuid IS NULL OR account_id = $2::uuid);

-- create_conversation --
-- params: account_id, title, model
-- A conversation belongs to exactly one account from birth.
INSERT INTO conversation (account_id, title, model)
VALUES ($1::uuid, $2::text, $3::text)
RETURNING id, account_id, title, model, archived_at, created_at, updated_at;

-- get_conversation --
-- params: conversation_id, account_id
-- Another account's conversation does not exist for you (docs/architecture.md rule 9).
SELECT id, account_id, title, model, archived_at, created_at, updated_at
FROM conversation
WHERE id = $1::uuid AND account_id = $2::uuid;

-- list_conversations --
-- params: account_id, limit, archived, after_updated_at, after_id
-- Most recently active first; archived ones only when asked for, and then only them. A page
-- after ($4, $5), the last one of the page before in this order (NULL: the first page): a
-- cursor of values, not of a row, so a conversation that became active meanwhile moves to the
-- top (where the next walk finds it) without shifting the pages after it.
SELECT id, account_id, title, model, archived_at, created_at, updated_at
FROM conversation
WHERE account_id = $1::uuid AND (archived_at IS NOT NULL) = $3::bool
  -- the index's bound: a later page starts where the last ended, not at the top
  AND updated_at <= coalesce($4::timestamptz, 'infinity')
  AND ($4::timestamptz IS NULL OR updated_at < $4::timestamptz OR id > $5::uuid)
ORDER BY updated_at DESC, id
LIMIT $2::int;

-- migration_session_unbounded --
-- A migrator waits for the lock and for the tables it alters as long as that takes, whatever
-- timeouts the database sets for its sessions (a pooled fleet sets lock and statement ones):
-- cut short, a fleet starting together would fail instead of waiting, and a long migration
-- could never finish. Read from pg_settings: transaction_timeout exists from PostgreSQL 17 on.
SELECT set_config(name, '0', false)
FROM pg_settings
WHERE name IN ('lock_timeout', 'statement_timeout', 'idle_in_transaction_session_timeout',
               'transaction_timeout');

-- migration_lock --
-- params: key
-- One migrator at a time across the fleet; the others wait, then find nothing left to do.
SELECT pg_advisory_lock($1::bigint);

-- migration_try_lock --
-- params: key
-- The same lock if it is free now (true); false: another migrator holds it (say so, then wait).
SELECT pg_try_advisory_lock($1::bigint);

-- migration_unlock --
-- params: key
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
-- params: version, name, checksum
-- Committed in the same transaction as the migration itself: applied exactly once.
INSERT INTO schema_migrations (version, name, checksum) VALUES ($1::int, $2::text, $3::text);

-- schema_migrations_exists --
-- Lets status/doctor report pending migrations on a database never migrated.
SELECT to_regclass('schema_migrations') IS NOT NULL;

-- ping --
-- Liveness probe for the hub's LISTEN connection and for readiness checks.
SELECT 1;

-- database_clock --
-- The daemon's clock is not trusted (docs/architecture.md rule 10): time comes from the database.
SELECT clock_timestamp();

-- database_exists --
-- params: name
-- The embedded server's database is created once, on first start.
SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1::text);

-- create_agentd_database --
-- A fixed name (identifiers cannot be bound parameters); used only on the embedded server.
CREATE DATABASE agentd;

-- queue_status --
-- What `agentd status` shows: queue depth, running turns and the workers holding live leases.
-- Both states as OR, not IN: PostgreSQL answers that from their partial indexes (sql/017).
SELECT
    count(*) FILTER (WHERE status = 'queued') AS queued,
    count(*) FILTER (WHERE status = 'running') AS running,
    count(*) FILTER (WHERE status = 'running' AND lease_expires_at <= clock_timestamp())
        AS expired,
    coalesce(array_agg(DISTINCT worker_id) FILTER (
        WHERE status = 'running' AND lease_expires_at > clock_timestamp()), '{}') AS workers
FROM agent_run
WHERE status = 'queued' OR status = 'running';

-- server_version --
-- Reported by doctor; agentd needs PostgreSQL 15 or newer.
SHOW server_version;

-- connection_budget --
-- The connections this server lets roles without superuser open (max_connections less the
-- slots it keeps back): a supervisor fits its workers' pools under it, so a fleet at full load
-- never meets "too many clients". reserved_connections exists from PostgreSQL 16 on.
SELECT current_setting('max_connections')::int
       - current_setting('superuser_reserved_connections')::int
       - coalesce(current_setting('reserved_connections', true)::int, 0) AS budget;

-- transcript_for_run --
-- params: conversation_id, user_message_id
-- What the model sees for a turn (turn_transcript, sql/011), in turn order.
SELECT t.role, t.content, t.tool_calls, t.tool_call_id
FROM turn_transcript($1::uuid, $2::uuid) WITH ORDINALITY AS t
ORDER BY t.ordinality;

-- presence_attach --
-- params: account_id, conversation_id, device_id, ttl_s
-- An open conversation stream registers its device; the row lives only while renewed.
WITH attached AS (
    INSERT INTO presence (account_id, conversation_id, device_id, expires_at)
    VALUES ($1::uuid, $2::uuid, $3::uuid, clock_timestamp() + make_interval(secs => $4::float8))
    RETURNING id, conversation_id
)
SELECT attached.id, pg_notify('agentd_conversation', attached.conversation_id::text)
FROM attached;

-- presence_renew --
-- params: presence_id, ttl_s
-- Keeps a stream's presence alive; zero rows means it expired (the stream re-attaches).
UPDATE presence SET expires_at = clock_timestamp() + make_interval(secs => $2::float8)
WHERE id = $1::uuid AND expires_at > clock_timestamp()
RETURNING id;

-- presence_detach --
-- params: presence_id
-- The stream ended: the device is no longer attached (and the feeds hear it at once).
WITH gone AS (
    DELETE FROM presence WHERE id = $1::uuid RETURNING conversation_id
)
SELECT pg_notify('agentd_conversation', gone.conversation_id::text) FROM gone;

-- purge_expired_presence --
-- Rows of streams whose server died without detaching; cosmetic, the reads filter them anyway.
DELETE FROM presence WHERE expires_at < clock_timestamp() - interval '1 minute';

-- lock_conversation --
-- params: conversation_id, account_id
-- Serializes run creation and stops per conversation (the enqueue takes the same lock first):
-- two `reject` requests cannot both see it idle, and a stop sweeps every turn committed before
-- it. NO KEY UPDATE, not UPDATE: claims and finishes insert rows referencing the conversation
-- (KEY SHARE locks) while holding run locks a stop waits for; FOR UPDATE would deadlock them.
-- Answers the model as locked: a turn built in this transaction runs on it, whatever changes it.
SELECT id, model FROM conversation WHERE id = $1::uuid AND account_id = $2::uuid
FOR NO KEY UPDATE;

-- list_runs_of_conversation_since --
-- params: conversation_id, after_created_at, after_id, open_run_ids
-- A conversation feed's discovery of runs: those after its watermark, plus the ones it still
-- follows, in run order; cancel_requested lets every device see a stop before the run ends.
SELECT id, status, created_at, cancel_requested
FROM agent_run
WHERE conversation_id = $1::uuid
  AND ((created_at, id) > ($2::timestamptz, $3::uuid) OR id = ANY ($4::uuid[]))
ORDER BY created_at, id;

-- update_conversation --
-- params: conversation_id, account_id, title, set_model, model, archived
-- Rename, set the model, archive or restore; only the owning account, only what the request
-- names ($4 and $6 say whether model and archived were given: NULL is a model). Archiving is
-- not activity, so it leaves updated_at (the list's order) alone. The feeds hear of it.
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
-- params: conversation_id
-- A feed's starting watermark: runs after it are new to the feed.
SELECT created_at, id FROM agent_run
WHERE conversation_id = $1::uuid
ORDER BY created_at DESC, id DESC
LIMIT 1;

-- run_status --
-- params: run_id
-- A tail's truth check when the journal is quiet: a terminal run without a journaled
-- `complete` gets one synthesized from this row.
SELECT status, error, error_code FROM agent_run WHERE id = $1::uuid;

-- search_messages --
-- params: account_id, pattern, limit, needle, width
-- Search across one account's conversations (titles and transcripts); scoped by account first.
-- The pattern is a bound parameter; LIKE metacharacters in it are escaped by the caller. A
-- matching title is one hit (its conversation's newest message), unless messages of that
-- conversation match themselves: it no longer fills the results with every message it holds.
-- A conversation with no message yet (or drafts only) is found by its title too: a hit with no
-- message, at its last activity. Each hit's content is at most `width` characters around the
-- first match (search_excerpt, sql/027): an answer stays small however long the messages are.
WITH said AS (
    SELECT c.id AS conversation_id, c.title, m.id AS message_id, m.role,
           search_excerpt(m.content, $4::text, $5::int) AS content,
           length(m.content) > $5::int AS truncated, m.created_at
    FROM message m
    JOIN conversation c ON c.id = m.conversation_id
    WHERE c.account_id = $1::uuid AND m.status <> 'draft'
      AND m.content ILIKE $2::text ESCAPE '\'
    ORDER BY m.created_at DESC
    LIMIT $3::int
), titled AS (
    SELECT c.id AS conversation_id, c.title, newest.id AS message_id, newest.role,
           search_excerpt(coalesce(newest.content, ''), $4::text, $5::int) AS content,
           coalesce(length(newest.content) > $5::int, false) AS truncated,
           coalesce(newest.created_at, c.updated_at) AS created_at
    FROM conversation c
    LEFT JOIN LATERAL (
        SELECT m.id, m.role, m.content, m.created_at FROM message m
        WHERE m.conversation_id = c.id AND m.status <> 'draft'
        ORDER BY m.position DESC
        LIMIT 1) newest ON true
    WHERE c.account_id = $1::uuid AND c.title ILIKE $2::text ESCAPE '\'
      AND NOT EXISTS (SELECT 1 FROM said WHERE said.conversation_id = c.id)
)
SELECT * FROM said
UNION ALL
SELECT * FROM titled
ORDER BY created_at DESC
LIMIT $3::int;

-- append_note_fenced --
-- params: conversation_id, fence, run_id, text
-- Downstream fencing (docs/providers.md, "Fenced writes"): the notebook raises its
-- per-conversation high-water mark and
-- appends in ONE statement; a fence lower than the mark (a superseded execution) updates and
-- inserts nothing (zero rows = rejected). The conflicting mark row is locked and re-checked, so
-- concurrent writers serialize on it and an older fence can never slip in after a newer one.
-- The writer must also still own its run, as for every worker write: running, lease live. This
-- refuses an execution paused past its lease even before its successor wrote a note (when the
-- mark alone cannot know it is stale). The run's row is locked first (FOR SHARE: an ending
-- waits for the append, or the append for it), as every worker write and a conversation's
-- delete take it: a delete holding it is waited for, never deadlocked with.
WITH writer AS (
    SELECT id FROM agent_run
    WHERE id = $3::uuid AND status = 'running' AND lease_expires_at > clock_timestamp()
    FOR SHARE
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
-- params: conversation_id
-- The highest fence the notebook has seen for a conversation (what a rejection reports).
SELECT fence FROM conversation_note_fence WHERE conversation_id = $1::uuid;

-- list_notes --
-- params: conversation_id, limit
-- A conversation's notes in the order written; the most recent $2 of them.
SELECT id, text, run_id, created_at FROM (
    SELECT id, text, run_id, created_at FROM conversation_note
    WHERE conversation_id = $1::uuid
    ORDER BY id DESC
    LIMIT $2::int
) AS latest
ORDER BY id;

-- notify_batch --
-- params: channels, payloads, fleet_wakes
-- Wake hints, many per statement (signals are hints, rows are truth: docs/architecture.md
-- rule 6): for rows already committed, in a transaction of their own, or for rows the caller's
-- open transaction wrote, which the hints then commit with (rule 1). A NOTIFY gives even a
-- transaction of its own an xid, so it writes a commit record (40 bytes of WAL) like any write.
-- A dispatchers' wake (agentd_run_enqueued, payload a conversation) comes from a turn's ending
-- and is decided here: only while that conversation's account has a turn queued, as this
-- statement sees it, can the ending have made one claimable; every claim loop would otherwise
-- claim nothing. Sent after the commit that caused it, no turn is missed: one queued before
-- this snapshot is seen here, one queued after it sends its own wake, which the claim loops
-- hear after that ending committed. With fleet_wakes false such a wake is decided but not
-- sent: the caller's own claim loop takes the turn (notifier.py says when). The check is a
-- function (account_has_queued_turn, sql/018), whose plan is cached: written out here, it
-- made this statement cost 0.4 ms to plan at every call; OFFSET 0 keeps the subquery whole,
-- so the check runs once per hint, not once for each use of `send`. Returns the places
-- (1-based) of the hints sent, or, for wakes with fleet_wakes false, decided.
SELECT coalesce(array_agg(t.n ORDER BY t.n) FILTER (WHERE t.send), '{}') AS sent,
       count(CASE WHEN t.send AND ($3::boolean OR t.channel <> 'agentd_run_enqueued')
                  THEN pg_notify(t.channel, t.payload) END) AS hints
FROM (
    SELECT h.n, h.channel, h.payload,
           CASE WHEN h.channel = 'agentd_run_enqueued'
                THEN account_has_queued_turn(h.payload::uuid)
                ELSE true END AS send
    FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS h (channel, payload, n)
    OFFSET 0
) t;

-- wake_claim_loops --
-- params: reason
-- Every claim loop of the fleet claims once more: a process that stops claiming (its drain)
-- hands on the wakes of its own endings it will no longer act on (notifier.py).
SELECT pg_notify('agentd_run_enqueued', $1::text);

-- lock_account_pairings --
-- params: account_id
-- Mints of one account take turns until their transaction ends (create_pairing follows in the
-- same transaction, with a snapshot taken after the turn came): their counts cannot all see
-- the same codes and all pass the bound. Keyed apart from every other advisory lock by its
-- first half (hashtext of 'agentd pairing').
SELECT pg_advisory_xact_lock(hashtext('agentd pairing'), hashtext($1::uuid::text));

-- create_pairing --
-- params: code_hash, account_id, device_name, created_by, ttl_s, max_open
-- A one-time code, stored only as its hash, valid until a deadline on the database clock; none
-- while the account holds max_open codes that can still be redeemed: neither spent nor expired,
-- nor minted by a device revoked since (no row: one device cannot grow the table without bound,
-- and a stolen device, once revoked, cannot keep its account from pairing). Run after
-- lock_account_pairings, in its transaction.
INSERT INTO pairing (code_hash, account_id, device_name, created_by, expires_at)
SELECT $1::bytea, $2::uuid, $3::text, $4::uuid,
       clock_timestamp() + make_interval(secs => $5::float8)
WHERE (SELECT count(*) FROM pairing p
       WHERE p.account_id = $2::uuid AND p.used_at IS NULL
         AND p.expires_at > clock_timestamp()
         AND (p.created_by IS NULL OR EXISTS (
             SELECT 1 FROM device maker
             WHERE maker.id = p.created_by AND maker.revoked_at IS NULL))) < $6::int
RETURNING expires_at;

-- redeem_pairing --
-- params: code_hash, device_name, token_hash
-- Spends a code and creates its device in ONE statement: the row lock makes a concurrent
-- redeemer re-check used_at and find it set, so exactly one wins. Expired, spent, unknown, or
-- minted by a device revoked since: no row, nothing created.
WITH spent AS (
    UPDATE pairing p
    SET used_at = clock_timestamp(), device_id = gen_random_uuid()
    WHERE p.code_hash = $1::bytea AND p.used_at IS NULL AND p.expires_at > clock_timestamp()
      AND (p.created_by IS NULL OR EXISTS (
          SELECT 1 FROM device maker WHERE maker.id = p.created_by AND maker.revoked_at IS NULL))
    RETURNING p.device_id, p.account_id, coalesce(p.device_name, $2::text) AS name
), created AS (
    INSERT INTO device (id, account_id, name, token_hash)
    SELECT device_id, account_id, name, $3::bytea FROM spent
    RETURNING id, account_id, name
)
SELECT created.id AS device_id, created.name AS device_name, a.id AS account_id,
       a.name AS account_name
FROM created JOIN account a ON a.id = created.account_id;

-- purge_pairings --
-- params: older_than_s
-- Spent and expired codes are kept a while for the audit trail, then dropped.
DELETE FROM pairing
WHERE expires_at < clock_timestamp() - make_interval(secs => $1::float8);

-- revoked_devices_among --
-- params: device_ids
-- Which of these devices may no longer stream: revoked, or gone with their account. One cheap
-- query per poll for every device with an open stream in this process.
SELECT wanted.id
FROM unnest($1::uuid[]) AS wanted (id)
WHERE NOT EXISTS (SELECT 1 FROM device d WHERE d.id = wanted.id AND d.revoked_at IS NULL);

-- list_account_devices --
-- params: account_id
-- An account's devices, for its own devices to see (never a token or its hash).
SELECT id, name, created_at, last_seen_at, revoked_at
FROM device
WHERE account_id = $1::uuid
ORDER BY created_at, id;

-- stage_own_password --
-- params: password
-- The embedded server's new password, as a transaction-local setting for set_own_password to
-- read: ALTER ROLE takes no bound parameters, and no SQL is ever built from the password.
SELECT set_config('agentd.new_password', $1::text, true);

-- set_own_password --
-- The embedded server requires a password (scram-sha-256, never trust): give its superuser the
-- one staged above, quoted by the server itself (format %L).
DO $$
BEGIN
    EXECUTE format('ALTER ROLE %I PASSWORD %L', current_user,
                   current_setting('agentd.new_password'));
END
$$;

-- request_tool_approval_fenced --
-- params: run_id, claim_token, call_id, tool, arguments, timeout_s
-- An `ask` tool call is recorded as pending only while this execution owns the run (FOR SHARE
-- serializes with finalizers, as every fenced write does); zero rows = LeaseLost, or a call id
-- the run already used for another call. The same call again from the same execution is its
-- own retry after a lost answer, and gets the approval recorded. The deadline is set on the
-- database clock. Returns who asked the turn, which every device's prompt shows.
WITH owner AS (
    SELECT id, account_id, claim_token, fence, origin_device_id FROM agent_run
    WHERE id = $1::uuid AND claim_token = $2::uuid AND status = 'running'
      AND lease_expires_at > clock_timestamp()
    FOR SHARE
), asked AS (
    INSERT INTO tool_approval (run_id, call_id, account_id, execution_id, fence, tool,
                               arguments, expires_at)
    SELECT owner.id, $3::text, owner.account_id, owner.claim_token, owner.fence, $4::text,
           $5::jsonb, clock_timestamp() + make_interval(secs => $6::float8)
    FROM owner
    ON CONFLICT (run_id, call_id) DO NOTHING
    RETURNING run_id, expires_at
), mine AS (
    SELECT asked.run_id, asked.expires_at FROM asked
    UNION ALL
    -- A retry after a lost answer: the same call, recorded by this execution's first attempt
    -- (the worker refuses a call id used twice in its turn before asking).
    SELECT a.run_id, a.expires_at
    FROM tool_approval a JOIN owner ON owner.id = a.run_id
    WHERE a.call_id = $3::text AND a.execution_id = owner.claim_token AND a.tool = $4::text
      AND a.arguments = $5::jsonb
)
SELECT mine.expires_at, owner.origin_device_id AS device_id, d.name AS device
FROM mine
JOIN owner ON owner.id = mine.run_id
LEFT JOIN device d ON d.id = owner.origin_device_id;

-- read_tool_approval --
-- params: run_id, call_id
-- The waiting worker's re-read (signals are hints, rows are truth): the decision if there is
-- one, who made it, and how long is left by the database clock.
SELECT a.decision, a.decided_by, d.name AS decided_by_name, a.timed_out, a.note,
       a.decided_at, a.expires_at,
       extract(epoch FROM a.expires_at - clock_timestamp())::float8 AS seconds_left
FROM tool_approval a
LEFT JOIN device d ON d.id = a.decided_by
WHERE a.run_id = $1::uuid AND a.call_id = $2::text;

-- expire_tool_approval_fenced --
-- params: run_id, claim_token, call_id, note
-- Undecided past its deadline (database clock): the worker that asked denies it as timed out,
-- with the same "decision still empty" guard a device's decision has, so exactly one of the
-- two lands. Fenced by the run's owner. Zero rows: decided first, or the lease is gone.
WITH owner AS (
    SELECT id FROM agent_run
    WHERE id = $1::uuid AND claim_token = $2::uuid AND status = 'running'
      AND lease_expires_at > clock_timestamp()
    FOR SHARE
)
UPDATE tool_approval a
SET decision = 'deny', timed_out = true, note = $4::text, decided_at = clock_timestamp()
FROM owner
WHERE a.run_id = owner.id AND a.execution_id = $2::uuid AND a.call_id = $3::text
  AND a.decision IS NULL AND a.expires_at <= clock_timestamp()
RETURNING a.decision;

-- decide_tool_approval --
-- params: run_id, call_id, account_id, device_id, decision, note
-- A device answers a pending approval: first decision wins, in ONE statement. It lands only
-- while the decision is empty, before the deadline, and while the execution that asked still
-- owns the run and was not asked to stop (FOR SHARE on the run: a finalizer cannot slip in
-- between). A concurrent second decision waits on the approval row's lock, re-checks
-- `decision IS NULL` and updates nothing. Scoped by account (rule 9). Wakes the waiting worker.
-- The deciding device must still be unrevoked (FOR SHARE: a revocation committing meanwhile is
-- waited for, so a device revoked after its token was checked decides nothing).
WITH owner AS (
    SELECT id, claim_token FROM agent_run
    WHERE id = $1::uuid AND account_id = $3::uuid AND status = 'running'
      AND NOT cancel_requested AND lease_expires_at > clock_timestamp()
    FOR SHARE
), decider AS (
    SELECT id FROM device
    WHERE id = $4::uuid AND account_id = $3::uuid AND revoked_at IS NULL
    FOR SHARE
), decided AS (
    UPDATE tool_approval a
    SET decision = $5::text, decided_by = decider.id, note = $6::text,
        decided_at = clock_timestamp()
    FROM owner, decider
    WHERE a.run_id = owner.id AND a.execution_id = owner.claim_token AND a.call_id = $2::text
      AND a.decision IS NULL AND a.expires_at > clock_timestamp()
    RETURNING a.run_id, a.call_id, a.tool, a.decision, a.note, a.decided_at
)
SELECT decided.*, (SELECT name FROM device WHERE id = $4::uuid) AS decided_by_name,
       pg_notify('agentd_approval', decided.run_id::text)
FROM decided;

-- explain_tool_approval --
-- params: run_id, call_id, account_id, device_id
-- Why a decision did not land: the approval as it is now, whether the execution that asked is
-- still waiting for it, and whether the deciding device was revoked meanwhile. Read-only;
-- scoped by account (rule 9).
SELECT a.tool, a.decision, d.name AS decided_by_name, a.decided_by, a.timed_out, a.note,
       a.decided_at,
       EXISTS (SELECT 1 FROM device WHERE id = $4::uuid AND revoked_at IS NOT NULL)
           AS decider_revoked,
       a.expires_at <= clock_timestamp() AS expired,
       (r.status = 'running' AND r.claim_token = a.execution_id AND NOT r.cancel_requested
        AND r.lease_expires_at > clock_timestamp()) AS waiting
FROM tool_approval a
JOIN agent_run r ON r.id = a.run_id
LEFT JOIN device d ON d.id = a.decided_by
WHERE a.run_id = $1::uuid AND a.call_id = $2::text AND a.account_id = $3::uuid;

-- list_tool_approvals --
-- params: run_id, account_id
-- A run's approvals in the order asked, with who decided each (rule 9: scoped by account).
-- pending: a decision can still land (as decide_tool_approval requires). An undecided one of a
-- turn stopped or ended while it waited stays undecided, and must not look like a question.
SELECT a.call_id, a.tool, a.arguments, a.requested_at, a.expires_at, a.decision,
       a.decided_by, d.name AS decided_by_name, a.timed_out, a.note, a.decided_at,
       (a.decision IS NULL AND a.expires_at > clock_timestamp() AND r.status = 'running'
        AND r.claim_token = a.execution_id AND NOT r.cancel_requested
        AND r.lease_expires_at > clock_timestamp()) AS pending
FROM tool_approval a
JOIN agent_run r ON r.id = a.run_id
LEFT JOIN device d ON d.id = a.decided_by
WHERE a.run_id = $1::uuid AND a.account_id = $2::uuid
ORDER BY a.requested_at, a.call_id;

-- conversation_meta --
-- params: conversation_id, account_id
-- Rule 9 and a feed's re-read, in one round trip: the conversation (zero rows: not yours, or
-- deleted, which ends every feed of it), the messages a retry or an edit superseded (each with
-- the user message that replaced it), the token totals of its runs, who owns it (the lease
-- columns, NULL without one: its deadline joined from the owning run, one source of truth, and
-- live decided by the database clock) and the devices attached now (by the database clock; a
-- device with two streams counts once, attached since its earliest; a revoked one never shows).
SELECT c.id, c.account_id, c.title, c.model, c.archived_at, c.created_at, c.updated_at,
       (SELECT coalesce(jsonb_object_agg(m.id, m.superseded_by), '{}'::jsonb)
        FROM message m
        WHERE m.conversation_id = c.id AND m.superseded_by IS NOT NULL) AS superseded,
       (SELECT jsonb_build_object(
                   'input_tokens', coalesce(sum((r.usage ->> 'input_tokens')::bigint), 0),
                   'output_tokens', coalesce(sum((r.usage ->> 'output_tokens')::bigint), 0),
                   'runs', count(*))
        FROM agent_run r
        WHERE r.conversation_id = c.id AND r.usage IS NOT NULL) AS usage,
       lease.run_id AS lease_run_id, lease.execution_id AS lease_execution_id,
       lease.fence AS lease_fence, lease.worker_id AS lease_worker_id,
       lease.device_id AS lease_device_id, lease.device AS lease_device,
       lease.expires_at AS lease_expires_at, lease.live AS lease_live,
       coalesce(attached.device_ids, '{}') AS attached_device_ids,
       coalesce(attached.devices, '{}') AS attached_devices,
       coalesce(attached.since, '{}') AS attached_since
FROM conversation c
LEFT JOIN LATERAL (
    SELECT l.run_id, l.execution_id, l.fence, l.worker_id, l.device_id, d.name AS device,
           r.lease_expires_at AS expires_at,
           (r.status = 'running' AND r.lease_expires_at > clock_timestamp()) AS live
    FROM conversation_lease l
    JOIN agent_run r ON r.id = l.run_id AND r.claim_token = l.execution_id
    LEFT JOIN device d ON d.id = l.device_id
    WHERE l.account_id = c.account_id AND l.conversation_id = c.id
) lease ON true
CROSS JOIN LATERAL (
    SELECT array_agg(a.device_id ORDER BY a.since, a.device) AS device_ids,
           array_agg(a.device ORDER BY a.since, a.device) AS devices,
           array_agg(a.since ORDER BY a.since, a.device) AS since
    FROM (SELECT d.id AS device_id, d.name AS device, min(p.since) AS since
          FROM presence p JOIN device d ON d.id = p.device_id
          WHERE p.conversation_id = c.id AND p.expires_at > clock_timestamp()
            AND d.revoked_at IS NULL
          GROUP BY d.id, d.name) a
) attached
WHERE c.id = $1::uuid AND c.account_id = $2::uuid;

-- runs_of_messages --
-- params: conversation_id, run_ids
-- What a page of messages shows of their runs: the model and token counts beside each answer,
-- the device that asked above each question. Only the page's runs, and only this
-- conversation's (the ids come from its messages).
SELECT r.id, r.request ->> 'model' AS model, r.usage, r.origin_device_id, d.name AS device
FROM agent_run r
LEFT JOIN device d ON d.id = r.origin_device_id
WHERE r.conversation_id = $1::uuid AND r.id = ANY ($2::uuid[]);

-- delete_conversation --
-- params: conversation_id, account_id
-- One statement removes a conversation and, by ON DELETE CASCADE, its runs, journal, leases,
-- presence, notes and messages. Runs after the stop sweep locked its active runs in the same
-- transaction (lock_conversation first, so no turn is enqueued or claimed half-way). Wakes the
-- feeds (they see it gone and end) and the tails of its running turn; the worker still running
-- it finds no row at its next fenced write (LeaseLost) and stops. A running turn gone frees its
-- account's running slot: the claim loops are woken too (one wake, however many ran), so a
-- turn of another conversation that the limit held back starts now, not at a poll.
WITH running AS (
    SELECT r.id FROM agent_run r
    WHERE r.conversation_id = $1::uuid AND r.account_id = $2::uuid AND r.status = 'running'
), gone AS (
    DELETE FROM conversation WHERE id = $1::uuid AND account_id = $2::uuid
    RETURNING id
)
SELECT gone.id, pg_notify('agentd_conversation', gone.id::text),
       (SELECT count(pg_notify('agentd_run_event', running.id::text)) FROM running) AS woken,
       (SELECT count(pg_notify('agentd_run_enqueued', $1::uuid::text)) FROM running)
           AS claims_woken
FROM gone;

-- fork_conversation --
-- params: conversation_id, account_id, message_id
-- A new conversation holding a copy of the transcript up to and including message $3, in one
-- statement that only reads the original. Only what has ended is copied: never a queued or
-- draft message nor a row of a turn still queued or running (so a fork works while a turn
-- runs); the results of a copied tool call come along, so a call and its result never split.
-- A superseded mark is kept only if the message that replaced it is copied too. Zero rows: no
-- such conversation; message_found false: no such message in it; id NULL: that message cannot
-- be forked from (its turn has not ended, or it is a draft).
WITH source AS (
    SELECT id, account_id, title, model FROM conversation
    WHERE id = $1::uuid AND account_id = $2::uuid
), eligible AS (
    SELECT m.id, m.role, m.content, m.status, m.tool_calls, m.tool_call_id, m.created_at,
           m.superseded_by, m.position, m.turn_position
    FROM message_turn m
    JOIN source ON source.id = m.conversation_id
    LEFT JOIN agent_run r ON r.id = m.run_id
    WHERE m.conversation_id = $1::uuid AND m.status NOT IN ('queued', 'draft')
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
-- params: conversation_id, message_id
-- Read under lock_conversation before a retry or an edit: the conversation's latest turn (its
-- last user message that is neither a draft nor superseded) and its run's status, and message
-- $2 (NULL: that latest one) with its run's request. Only the latest turn, once ended, can be
-- re-run: the caller turns these columns into the 404 or 409 that says why not.
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
-- params: conversation_id, message_id, superseded_by
-- A retry or an edit replaced the latest turn: its user message $2 and everything after it in
-- turn order (tool steps, the answer) are marked with the new user message $3, in the
-- transaction that enqueued the new turn, under lock_conversation. Drafts are no exchange's.
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
