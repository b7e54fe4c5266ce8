-- Limits without a queue behind one row, and the claim as a function of small indexed steps.
--
-- Before (sql/009): an account's limits were counts read under a lock on its row, taken by the
-- claim and by the enqueue alike, so every claim and every enqueue of one account took turns —
-- each holding the lock for the rest of its transaction — and the claim was one statement of a
-- dozen CTEs that hash-joined the whole agent_run table. docs/benchmarks.md has the figures.
--
-- Now a limit is a set of numbered slots. A queued turn holds a queue slot in 1..max_queued, a
-- running turn a running slot in 1..max_running (the `slot` column, reassigned by the claim);
-- two unique partial indexes let no two turns of one account hold the same slot in the same
-- state, so neither limit can be exceeded whatever the snapshots say. A turn gives its slot
-- back by leaving the state (its row leaves the partial index): finishes, stops and deletes
-- touch nothing new. Whoever takes a slot first locks it for its transaction with a try-lock
-- that never waits (pg_try_advisory_xact_lock, keyed by account and slot), then re-checks it
-- with a fresh snapshot: a rival still in flight holds the lock, one that committed is seen.
-- Claims and enqueues of one account run side by side, never waiting on each other.
-- A slot number above the limit (the limit was lowered) holds the account back: nothing more
-- is queued, or started, until those turns have left that state.

ALTER TABLE agent_run ADD COLUMN slot integer CHECK (slot >= 1);
UPDATE agent_run r SET slot = n.nth
FROM (SELECT a.id, row_number() OVER (PARTITION BY a.account_id, a.status
                                      ORDER BY a.created_at, a.id) AS nth
      FROM agent_run a WHERE a.status IN ('queued', 'running')) n
WHERE r.id = n.id;
ALTER TABLE agent_run ADD CONSTRAINT agent_run_active_slot
    CHECK (status NOT IN ('queued', 'running') OR slot IS NOT NULL);
CREATE UNIQUE INDEX agent_run_queued_slot ON agent_run (account_id, slot)
    WHERE status = 'queued';
CREATE UNIQUE INDEX agent_run_running_slot ON agent_run (account_id, slot)
    WHERE status = 'running';
-- A run and a conversation lease belong to their account through their conversation: one key
-- (the conversation's id with its account) instead of a key on the account row, which every
-- enqueue and every claim of the account locked (FOR KEY SHARE) and so made the one row all of
-- an account's writes met on. Deleting an account still removes everything (via conversation).
ALTER TABLE conversation ADD CONSTRAINT conversation_id_account_key UNIQUE (id, account_id);
ALTER TABLE agent_run DROP CONSTRAINT agent_run_account_id_fkey,
    DROP CONSTRAINT agent_run_conversation_id_fkey,
    ADD CONSTRAINT agent_run_conversation_account_fkey FOREIGN KEY (conversation_id, account_id)
        REFERENCES conversation (id, account_id) ON DELETE CASCADE;
ALTER TABLE conversation_lease DROP CONSTRAINT conversation_lease_account_id_fkey,
    DROP CONSTRAINT conversation_lease_conversation_id_fkey,
    ADD CONSTRAINT conversation_lease_conversation_account_fkey
        FOREIGN KEY (conversation_id, account_id)
        REFERENCES conversation (id, account_id) ON DELETE CASCADE;

-- The running slots' index serves the per-account count of running turns (sql/009) too.
DROP INDEX agent_run_account_running_idx;
-- The claim's FIFO per conversation: a conversation's queued turns in arrival order (the claim
-- now scans by account, so the fleet-wide arrival index has no reader left).
DROP INDEX agent_run_queued_idx;
CREATE INDEX agent_run_conversation_queued_idx ON agent_run (conversation_id, created_at, id)
    WHERE status = 'queued';
DROP FUNCTION account_running_room(uuid, integer);
DROP FUNCTION account_queue_has_room(uuid, integer);

-- Plans. The claim's write, the batched terminal write and the claim's own steps keep one
-- generic plan each per connection (planning them anew on every call cost more than running
-- them, up to 2 ms a claim). A generic plan is only as good as the statistics it was made
-- with: agentd refreshes those of its hot tables while they are young (statistics.py), which
-- also makes every cached plan be made again.

-- A free queue slot of the account, locked for this transaction. Picked at random in
-- 1..cap (a queue far from full has one at once, and rival enqueuers rarely meet); locked first,
-- so a rival still in flight holds it and we do not take it; a run that committed holding it
-- since is turned away by the queued-slot index when the caller inserts (it then asks again).
-- With `exact`, the free slots in order instead (read after the lock, so a committed holder is
-- seen), or NULL when there is none: the queue is full. A lowered max_queued leaves the turns
-- already queued in place (their slots may lie above it); new ones get slots below it.
CREATE FUNCTION take_queue_slot(of_account uuid, cap integer, exact boolean) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    key integer := hashtext('agentd.queued ' || of_account);
    wanted integer;
BEGIN
    IF cap < 1 THEN
        RETURN NULL;
    END IF;
    IF NOT exact THEN
        FOR attempt IN 1..3 LOOP
            wanted := 1 + floor(random() * cap)::integer;
            IF pg_try_advisory_xact_lock(key, wanted) THEN
                RETURN wanted;
            END IF;
        END LOOP;
    END IF;
    FOR wanted IN
        SELECT g FROM generate_series(1, cap) g
        EXCEPT SELECT r.slot FROM agent_run r
               WHERE r.account_id = of_account AND r.status = 'queued'
        ORDER BY 1
    LOOP
        IF pg_try_advisory_xact_lock(key, wanted) AND NOT EXISTS (
                SELECT 1 FROM agent_run r WHERE r.account_id = of_account
                AND r.status = 'queued' AND r.slot = wanted) THEN
            RETURN wanted;
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;

-- Up to `want` free running slots of the account, each locked for this transaction; none
-- while a turn runs above `cap` (the limit was lowered: the account waits until those end).
-- Taken at random among the lowest free ones: rival claimers of one account seldom try the
-- same one, and no slot number is reused so often that its index key gathers dead entries
-- faster than they are cleaned up. A slot that a claim committed since our snapshot cannot be
-- taken twice: the unique index refuses the second (the caller claims again).
CREATE FUNCTION take_running_slots(of_account uuid, cap integer, want integer)
RETURNS integer[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    key integer := hashtext('agentd.running ' || of_account);
    taken integer[];
    wanted integer;
    got integer[] := '{}';
BEGIN
    taken := ARRAY(SELECT r.slot FROM agent_run r
                   WHERE r.account_id = of_account AND r.status = 'running');
    IF want < 1 OR cardinality(taken) >= cap
       OR EXISTS (SELECT 1 FROM unnest(taken) t WHERE t > cap) THEN
        RETURN got;
    END IF;
    FOR wanted IN
        SELECT f.slot FROM (
            SELECT g AS slot
            FROM generate_series(1, least(cap, cardinality(taken) + 2 * want + 32)) g
            WHERE g <> ALL (taken)) f
        ORDER BY random()
    LOOP
        IF pg_try_advisory_xact_lock(key, wanted) THEN
            got := got || wanted;
            EXIT WHEN cardinality(got) = want;
        END IF;
    END LOOP;
    RETURN got;
END;
$$;

-- Step 5 of claim_runs: start the admitted runs, each with its running slot. The caller holds
-- their rows locked, taken while queued (FOR UPDATE re-checks a row as it is once locked), so
-- they are queued still. Simple statements, each by primary key or by the arrays it is given.
CREATE FUNCTION start_claimed_runs(worker text, lease_ttl_s float8, admitted uuid[],
                                   admitted_slots integer[], served_accounts uuid[])
RETURNS TABLE (id uuid, account_id uuid, conversation_id uuid, user_message_id uuid,
               origin_device_id uuid, request jsonb, claim_token uuid, fence bigint,
               worker_id text, lease_expires_at timestamptz, cancel_requested boolean,
               created_at timestamptz, started_at timestamptz, last_seq bigint)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    now timestamptz := clock_timestamp();
    runs uuid[];
    accounts uuid[];
    conversations uuid[];
    questions uuid[];
    devices uuid[];
    requests jsonb[];
    tokens uuid[];
    fences bigint[];
    deadlines timestamptz[];
    cancels boolean[];
    created timestamptz[];
    leased uuid[];
    seqs bigint[];
BEGIN
    WITH claimed AS (
        UPDATE agent_run r
        SET status = 'running',
            claim_token = gen_random_uuid(),
            fence = nextval('agent_run_fence_seq'),
            worker_id = worker,
            lease_expires_at = now + make_interval(secs => lease_ttl_s),
            last_heartbeat_at = now,
            started_at = now,
            slot = admitted_slots[array_position(admitted, r.id)]
        WHERE r.id = ANY (admitted)
        RETURNING r.id, r.account_id, r.conversation_id, r.user_message_id, r.origin_device_id,
                  r.request, r.claim_token, r.fence, r.lease_expires_at, r.cancel_requested,
                  r.created_at
    )
    SELECT array_agg(c.id), array_agg(c.account_id), array_agg(c.conversation_id),
           array_agg(c.user_message_id), array_agg(c.origin_device_id), array_agg(c.request),
           array_agg(c.claim_token), array_agg(c.fence), array_agg(c.lease_expires_at),
           array_agg(c.cancel_requested), array_agg(c.created_at)
    INTO runs, accounts, conversations, questions, devices, requests, tokens, fences,
         deadlines, cancels, created
    FROM claimed c;
    -- Round robin's clock: the accounts served now go to the back of the line.
    UPDATE account a SET last_claimed_at = now WHERE a.id = ANY (served_accounts);
    UPDATE message m SET status = 'complete'
    WHERE m.id = ANY (questions) AND m.status = 'queued';
    -- The conversation lease: taken over only from a holder whose run is no longer live.
    WITH taken AS (
        INSERT INTO conversation_lease AS held (account_id, conversation_id, run_id,
                                                execution_id, fence, worker_id, device_id,
                                                acquired_at)
        SELECT l.account_id, l.conversation_id, l.run_id, l.execution_id, l.fence, worker,
               l.device_id, now
        FROM unnest(accounts, conversations, runs, tokens, fences, devices)
            AS l (account_id, conversation_id, run_id, execution_id, fence, device_id)
        ON CONFLICT ON CONSTRAINT conversation_lease_pkey DO UPDATE
        SET run_id = EXCLUDED.run_id,
            execution_id = EXCLUDED.execution_id,
            fence = EXCLUDED.fence,
            worker_id = EXCLUDED.worker_id,
            device_id = EXCLUDED.device_id,
            acquired_at = EXCLUDED.acquired_at
        WHERE NOT coalesce((
            SELECT holder.claim_token = held.execution_id AND holder.status = 'running'
                   AND holder.lease_expires_at > now
            FROM agent_run holder WHERE holder.id = held.run_id), false)
        RETURNING held.run_id
    )
    SELECT array_agg(t.run_id) INTO leased FROM taken t;
    PERFORM require_conversation_lease(r = ANY (coalesce(leased, '{}')), r)
    FROM unnest(runs) r;
    -- The claim journals its own run_started: one commit less before the first token.
    WITH journaled AS (
        INSERT INTO run_event AS e (run_id, seq, type, payload)
        SELECT j.run_id, (SELECT max(p.seq) FROM run_event p WHERE p.run_id = j.run_id) + 1,
               'run_started',
               jsonb_build_object('worker_id', worker, 'fence', j.fence,
                                  'lease_expires_at',
                                  to_char(j.deadline AT TIME ZONE 'UTC',
                                          'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))
        FROM unnest(runs, fences, deadlines) AS j (run_id, fence, deadline)
        RETURNING e.run_id, e.seq
    )
    SELECT array_agg(j.seq ORDER BY r.n) INTO seqs
    FROM unnest(runs) WITH ORDINALITY AS r (run_id, n)
    JOIN journaled j ON j.run_id = r.run_id;
    RETURN QUERY
    SELECT * FROM unnest(runs, accounts, conversations, questions, devices, requests, tokens,
                         fences, array_fill(worker, ARRAY[cardinality(runs)]), deadlines,
                         cancels, created, array_fill(now, ARRAY[cardinality(runs)]), seqs);
END;
$$;

-- The turns a claim may start now, round robin over accounts (the one served longest ago first,
-- one turn of each before a second of any), FIFO within each account, within its running limit
-- (docs/architecture.md: claim in one statement, one turn at a time per conversation). Called
-- as ONE statement, so the claim still commits whole or not at all.
--
-- 1. The accounts with queued turns (a loose scan of their index), in serving order; then for
--    each in turn, until `want` turns are claimed:
-- 2. its share: what is left, split evenly over the accounts still to come;
-- 4. that many free running slots, at most (take_running_slots): none when it is at its limit;
-- 3. as many of its oldest eligible turns (only a conversation's oldest queued one, none while
--    the conversation runs one), locked with SKIP LOCKED: rival claimers pass over each other's.
-- 5. The write (start_claimed_runs): the runs (fresh claim token, fence, deadline on the
--    database clock, the slot), their question messages, the accounts' place in the round
--    robin, the conversation leases and run_started (the lease guard raises if a live holder
--    kept one: nothing commits).
CREATE FUNCTION claim_runs(worker text, lease_ttl_s float8, want integer,
                           default_max_running integer)
RETURNS TABLE (id uuid, account_id uuid, conversation_id uuid, user_message_id uuid,
               origin_device_id uuid, request jsonb, claim_token uuid, fence bigint,
               worker_id text, lease_expires_at timestamptz, cancel_requested boolean,
               created_at timestamptz, started_at timestamptz, last_seq bigint)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    accounts uuid[];
    caps integer[];
    left_over integer := want;
    share integer;
    slots integer[];
    picked uuid[];
    admitted uuid[] := '{}';
    admitted_slots integer[] := '{}';
    served_accounts uuid[] := '{}';
    n integer;
BEGIN
    IF want < 1 THEN
        RETURN;
    END IF;
    -- 1
    SELECT array_agg(acc.id ORDER BY acc.last_claimed_at NULLS FIRST, acc.id),
           array_agg(coalesce(acc.max_running, default_max_running)
                     ORDER BY acc.last_claimed_at NULLS FIRST, acc.id)
    INTO accounts, caps
    FROM (
        WITH RECURSIVE queued_accounts AS (
            (SELECT q.account_id FROM agent_run q WHERE q.status = 'queued'
             ORDER BY q.account_id LIMIT 1)
            UNION ALL
            SELECT (SELECT q.account_id FROM agent_run q
                    WHERE q.status = 'queued' AND q.account_id > seen.account_id
                    ORDER BY q.account_id LIMIT 1)
            FROM queued_accounts seen
            WHERE seen.account_id IS NOT NULL
        )
        SELECT qa.account_id FROM queued_accounts qa WHERE qa.account_id IS NOT NULL
    ) qa
    JOIN account acc ON acc.id = qa.account_id;
    n := coalesce(cardinality(accounts), 0);
    FOR i IN 1..n LOOP
        EXIT WHEN left_over = 0;
        -- 2: an even share of what is left, to the accounts not yet served in this claim
        share := ceil(left_over::numeric / (n - i + 1))::integer;
        -- 4 (before 3, so an account at its limit locks none of its turns)
        slots := take_running_slots(accounts[i], caps[i], share);
        CONTINUE WHEN cardinality(slots) = 0;
        -- 3
        picked := ARRAY(
            SELECT q.id FROM agent_run q
            WHERE q.account_id = accounts[i] AND q.status = 'queued'
              AND NOT EXISTS (
                  SELECT 1 FROM agent_run busy
                  WHERE busy.conversation_id = q.conversation_id AND busy.status = 'running')
              AND q.id = (
                  SELECT head.id FROM agent_run head
                  WHERE head.conversation_id = q.conversation_id AND head.status = 'queued'
                  ORDER BY head.created_at, head.id
                  LIMIT 1)
            ORDER BY q.created_at, q.id
            LIMIT cardinality(slots)
            FOR UPDATE SKIP LOCKED);
        CONTINUE WHEN cardinality(picked) = 0;
        admitted := admitted || picked;
        admitted_slots := admitted_slots || slots[1:cardinality(picked)];
        left_over := left_over - cardinality(picked);
        -- Round robin's clock is written by one claimer of the account at a time; a rival
        -- writing it now writes the same moment, so we leave it to them rather than wait.
        IF pg_try_advisory_xact_lock(hashtext('agentd.served ' || accounts[i]), 0) THEN
            served_accounts := served_accounts || accounts[i];
        END IF;
    END LOOP;
    IF cardinality(admitted) = 0 THEN
        RETURN;
    END IF;
    -- 5
    RETURN QUERY SELECT * FROM start_claimed_runs(worker, lease_ttl_s, admitted, admitted_slots,
                                                  served_accounts);
END;
$$;

-- The terminal writes of runs ending together, in ONE statement and one commit (group commit:
-- group_commit.py), each fenced on its own exactly as a worker's every write is
-- (docs/architecture.md rule 3: its claim token, status running, deadline ahead on the
-- database clock); a run refused is missing from the answer while the others end. Per run, in
-- the same statement: its last journal batch (the deltas still in the emitter's buffer), the
-- repair of tool calls it left open (answer_open_tool_calls, sql/004), the answer message, the
-- one 'complete' event (at `seq`, or max+1 for the dispatcher's backstop) and the release of
-- its conversation lease by execution id. A `failed` run's answer is the text its journal
-- holds (journal_text, sql/008) plus the deltas written here, with status `failed`: exactly
-- what every client saw. A seq someone else took fails the whole statement (a unique
-- violation): the caller then ends each run alone to tell whose it was.
CREATE FUNCTION finish_runs(run_ids uuid[], claim_tokens uuid[], statuses text[],
                            errors text[], error_codes text[], usages text[], contents text[],
                            message_statuses text[], seqs bigint[], event_run_ids uuid[],
                            event_seqs bigint[], event_types text[], event_payloads text[])
RETURNS TABLE (id uuid, conversation_id uuid, message_id uuid, repaired_calls bigint)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH clock AS (
        SELECT clock_timestamp() AS now
    ), ending AS (
        SELECT * FROM unnest(run_ids, claim_tokens, statuses, errors, error_codes, usages,
                             contents, message_statuses, seqs)
            AS f (run_id, claim_token, status, error, error_code, usage, content,
                  message_status, seq)
    ), fin AS (
        UPDATE agent_run r
        SET status = f.status, error = f.error, error_code = f.error_code,
            usage = f.usage::jsonb, finished_at = clock.now
        FROM ending f, clock
        WHERE r.id = f.run_id AND r.claim_token = f.claim_token AND r.status = 'running'
          AND r.lease_expires_at > clock.now
        RETURNING r.id, r.account_id, r.conversation_id, r.claim_token
    ), last AS (
        SELECT * FROM unnest(event_run_ids, event_seqs, event_types, event_payloads)
            AS e (run_id, seq, type, payload)
    ), journaled AS (
        INSERT INTO run_event (run_id, seq, type, payload)
        SELECT e.run_id, e.seq, e.type, e.payload::jsonb
        FROM last e JOIN fin ON fin.id = e.run_id
        RETURNING run_id
    ), repaired AS (
        -- Tool calls left open get their `cancelled` results before the answer, which reads
        -- from here (so the transcript stays in turn order).
        SELECT fin.id AS run_id, answer_open_tool_calls(fin.id) AS calls FROM fin
    ), answer AS (
        INSERT INTO message (conversation_id, run_id, role, content, status)
        SELECT fin.conversation_id, fin.id, 'assistant', said.content, said.status
        FROM fin
        JOIN ending f ON f.run_id = fin.id
        JOIN repaired ON repaired.run_id = fin.id
        CROSS JOIN LATERAL (
            SELECT nullif(journal_text(fin.id) || coalesce(
                       (SELECT string_agg(e.payload::jsonb ->> 'delta', '' ORDER BY e.seq)
                        FROM last e
                        WHERE e.run_id = fin.id AND e.type = 'content_delta'), ''),
                   '') AS content,
                   'failed' AS status
            WHERE f.status = 'failed'
            UNION ALL
            SELECT f.content, f.message_status WHERE f.status <> 'failed') said
        WHERE said.content IS NOT NULL
        RETURNING message.id, message.run_id
    ), ended AS (
        INSERT INTO run_event (run_id, seq, type, payload)
        SELECT fin.id,
               coalesce(f.seq, (SELECT max(j.seq) + 1 FROM run_event j WHERE j.run_id = fin.id)),
               'complete',
               jsonb_build_object('status', f.status, 'error', f.error,
                                  'error_code', f.error_code, 'message_id', a.id,
                                  'usage', f.usage::jsonb)
        FROM fin
        JOIN ending f ON f.run_id = fin.id
        LEFT JOIN answer a ON a.run_id = fin.id
    ), released AS (
        DELETE FROM conversation_lease l
        USING fin
        WHERE l.account_id = fin.account_id AND l.conversation_id = fin.conversation_id
          AND l.execution_id = fin.claim_token
    )
    SELECT fin.id, fin.conversation_id, a.id, repaired.calls
    FROM fin
    JOIN repaired ON repaired.run_id = fin.id
    LEFT JOIN answer a ON a.run_id = fin.id;
END;
$$;

-- What the model sees for a turn: every earlier turn (question, tool steps, answer) and its own
-- question, in turn order; minus turns not yet run (queued), handed back (draft), or replaced
-- by a retry or an edit (superseded). Read by a turn's first statement (open_turn) and by
-- transcript_for_run.
CREATE FUNCTION turn_transcript(of_conversation uuid, question uuid)
RETURNS TABLE (role text, content text, tool_calls jsonb, tool_call_id text)
LANGUAGE sql STABLE AS $$
    SELECT m.role, m.content, m.tool_calls, m.tool_call_id
    FROM message m
    LEFT JOIN agent_run r ON r.id = m.run_id
    LEFT JOIN message asked ON asked.id = r.user_message_id
    WHERE m.conversation_id = of_conversation
      AND coalesce(asked.position, m.position)
          <= (SELECT q.position FROM message q WHERE q.id = question)
      AND m.status NOT IN ('queued', 'draft') AND m.superseded_by IS NULL
    ORDER BY coalesce(asked.position, m.position), m.position;
$$;
