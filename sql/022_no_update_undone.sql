-- A post no longer writes a row that others lock and then undoes the write.
--
-- A post refused, or not started directly, used to update its conversation's row (its
-- updated_at, which was also its lock) inside a subtransaction and then roll that back
-- (post_turn, sql/019 and sql/021). Meanwhile parallel posts key-share-lock the same row (the
-- foreign keys of the rows they insert) and update it. PostgreSQL 18 was seen to fail such a
-- rival's update with "new multixact has more than one updating member" (an internal error,
-- so the post answered 500): for a moment after a subtransaction aborts, the row's lock list
-- can still count its undone update as in progress beside the rival's own.
--
-- Now the row is locked without being written (FOR NO KEY UPDATE, the lock an update takes:
-- key-share locks of inserts beside it still pass), in a statement of its own, and updated_at
-- is written once a turn is written, by the statement that wrote it:
--   * enqueue_runs locks its conversations first, in id order (two calls naming several of
--     the same conversations no longer deadlock), and moves updated_at only for those it wrote
--     a turn into: a refused turn writes nothing at all;
--   * start_posted_turn locks the conversation first and writes updated_at last, after every
--     step that can refuse or fail, so its subtransaction never undoes a write to that row;
--   * post_turn calls the enqueue without a subtransaction: with nothing to undo, a refused
--     post keeps the conversation locked until its transaction commits (in the daemon, at the
--     end of this statement).
--   * the claim beside an enqueue (sql/015) picks first and writes only when it picked the
--     enqueue's own turn: a claim that picked another turn used to start it, move its account's
--     round-robin clock (a row every insert of the account key-share-locks) and roll both back.
--     claim_runs is the same pick followed by the same write, which now moves the account's
--     clock after the conversation lease, the last step that can fail.
-- The statement that locks comes before the one that updates, each with its own snapshot: the
-- update meets the version locked (an update in the same statement as the lock went back to
-- the version the statement began with and deadlocked: sql/019).

-- enqueue_runs (sql/019): the conversations locked first; updated_at moved for a turn written.
CREATE OR REPLACE FUNCTION enqueue_runs(of_account uuid, conversation_ids uuid[], device uuid,
                             contents text[], requests text[], request_hashes text[],
                             idempotency_keys text[], default_max_queued integer,
                             wake_dispatchers boolean)
RETURNS TABLE (n bigint, conversation boolean, slot integer, max_queued integer, id uuid,
               status text, user_message_id uuid, created_at timestamptz, hints bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
BEGIN
    -- The lock, in a statement of its own and in one order (the statement below takes its
    -- snapshot after it, so its update meets the version locked here).
    PERFORM FROM conversation c
    WHERE c.id = ANY (conversation_ids) AND c.account_id = of_account
    ORDER BY c.id
    FOR NO KEY UPDATE;
    RETURN QUERY
    WITH item AS (
        SELECT i.*
        FROM unnest(conversation_ids, contents, requests, request_hashes, idempotency_keys)
            WITH ORDINALITY AS i (conversation_id, content, request, request_hash,
                                  idempotency_key, n)
    ), conv AS (
        SELECT c.id, c.account_id, coalesce(a.max_queued, default_max_queued) AS max_queued
        FROM conversation c JOIN account a ON a.id = c.account_id
        WHERE c.id = ANY (conversation_ids) AND c.account_id = of_account
    ), asking AS (
        SELECT item.*, conv.account_id, conv.max_queued, gen_random_uuid() AS message_id,
               row_number() OVER (ORDER BY item.n) AS place
        FROM item JOIN conv ON conv.id = item.conversation_id
        WHERE item.idempotency_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM agent_run used
            WHERE used.account_id = of_account AND used.idempotency_key = item.idempotency_key)
    ), slots AS (
        SELECT take_queue_slots(of_account, (SELECT max(conv.max_queued) FROM conv),
                                (SELECT count(*) FROM asking)::int) AS taken
    ), slotted AS (
        SELECT asking.*, (SELECT slots.taken FROM slots)[asking.place] AS slot
        FROM asking
    ), run AS (
        INSERT INTO agent_run AS r (account_id, conversation_id, user_message_id,
                                    origin_device_id, request, request_hash, idempotency_key,
                                    created_at, slot)
        SELECT s.account_id, s.conversation_id, s.message_id, device, s.request::jsonb,
               s.request_hash, s.idempotency_key, clock_timestamp(), s.slot
        FROM slotted s
        WHERE s.slot IS NOT NULL
        ORDER BY s.n
        ON CONFLICT DO NOTHING
        RETURNING r.id, r.conversation_id, r.user_message_id, r.status, r.created_at
    ), msg AS (
        INSERT INTO message (id, conversation_id, run_id, role, content, status)
        SELECT r.user_message_id, r.conversation_id, r.id, 'user', s.content, 'queued'
        FROM run r JOIN slotted s ON s.message_id = r.user_message_id
        ORDER BY s.n
    ), journal AS (
        INSERT INTO run_event (run_id, seq, type, payload)
        SELECT r.id, e.seq, e.type, e.payload
        FROM run r JOIN slotted s ON s.message_id = r.user_message_id
        CROSS JOIN LATERAL (VALUES
            (1, 'user_message', jsonb_build_object(
                'message_id', r.user_message_id, 'role', 'user', 'content', s.content)),
            (2, 'run_queued', jsonb_build_object(
                'run_id', r.id, 'conversation_id', r.conversation_id, 'device_id', device,
                'device', (SELECT d.name FROM device d WHERE d.id = device)))
        ) AS e (seq, type, payload)
    ), touched AS (
        -- The conversation list's order moves for a turn written, and only then.
        UPDATE conversation c SET updated_at = clock_timestamp()
        WHERE c.id IN (SELECT r.conversation_id FROM run r)
    ), woken AS (
        SELECT count(CASE WHEN wake_dispatchers
                          THEN pg_notify('agentd_run_enqueued', w.conversation_id::text) END)
             + count(pg_notify('agentd_conversation', w.conversation_id::text)) AS hints
        FROM (SELECT DISTINCT r.conversation_id FROM run r) w
    )
    SELECT item.n, conv.id IS NOT NULL, s.slot, conv.max_queued, r.id, r.status,
           r.user_message_id, r.created_at, (SELECT woken.hints FROM woken)
    FROM item
    LEFT JOIN conv ON conv.id = item.conversation_id
    LEFT JOIN slotted s ON s.n = item.n
    LEFT JOIN run r ON r.user_message_id = s.message_id
    ORDER BY item.n;
END;
$$;

-- start_posted_turn (sql/021): the conversation locked first; updated_at written last.
CREATE OR REPLACE FUNCTION start_posted_turn(of_account uuid, of_conversation uuid, device uuid,
                                  content text, request text, request_hash text,
                                  idempotency_key text, default_max_queued integer,
                                  worker text, lease_ttl_s float8, default_max_running integer)
RETURNS TABLE (max_queued integer, slot integer, id uuid, user_message_id uuid,
               created_at timestamptz, claim_token uuid, fence bigint,
               lease_expires_at timestamptz, last_seq bigint)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    queue_cap integer;
    run_cap integer;
    slots integer[];
    now timestamptz;
    question uuid := gen_random_uuid();
    run record;
    leased boolean;
BEGIN
    SELECT coalesce(a.max_queued, default_max_queued),
           coalesce(a.max_running, default_max_running)
    INTO queue_cap, run_cap
    FROM conversation c JOIN account a ON a.id = c.account_id
    WHERE c.id = of_conversation AND c.account_id = of_account
    FOR NO KEY UPDATE OF c;
    IF NOT FOUND OR queue_cap < 1 THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM agent_run q WHERE q.status = 'queued')
       OR EXISTS (SELECT 1 FROM agent_run busy
                  WHERE busy.conversation_id = of_conversation AND busy.status = 'running')
       OR (idempotency_key IS NOT NULL AND EXISTS (
               SELECT 1 FROM agent_run used
               WHERE used.account_id = of_account
                 AND used.idempotency_key = start_posted_turn.idempotency_key))
    THEN
        RETURN;
    END IF;
    slots := take_running_slots(of_account, run_cap, 1);
    IF cardinality(slots) = 0 THEN
        RETURN;
    END IF;
    now := clock_timestamp();  -- after the conversation's lock: created_at in commit order
    INSERT INTO agent_run AS r (account_id, conversation_id, user_message_id, origin_device_id,
                                request, request_hash, idempotency_key, created_at, slot,
                                status, claim_token, fence, worker_id, lease_expires_at,
                                last_heartbeat_at, started_at)
    VALUES (of_account, of_conversation, question, device, request::jsonb, request_hash,
            idempotency_key, now, slots[1], 'running', gen_random_uuid(),
            nextval('agent_run_fence_seq'), worker, now + make_interval(secs => lease_ttl_s),
            now, now)
    ON CONFLICT DO NOTHING
    RETURNING r.id, r.claim_token, r.fence, r.lease_expires_at INTO run;
    IF run.id IS NULL THEN
        RETURN;
    END IF;
    INSERT INTO message (id, conversation_id, run_id, role, content, status)
    VALUES (question, of_conversation, run.id, 'user', content, 'complete');
    INSERT INTO run_event (run_id, seq, type, payload) VALUES
        (run.id, 1, 'user_message', jsonb_build_object(
            'message_id', question, 'role', 'user', 'content', content)),
        (run.id, 2, 'run_queued', jsonb_build_object(
            'run_id', run.id, 'conversation_id', of_conversation, 'device_id', device,
            'device', (SELECT d.name FROM device d WHERE d.id = device))),
        (run.id, 3, 'run_started', jsonb_build_object(
            'worker_id', worker, 'fence', run.fence,
            'lease_expires_at', to_char(run.lease_expires_at AT TIME ZONE 'UTC',
                                        'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')));
    -- The conversation lease, as the claim takes it: only from a holder no longer live.
    INSERT INTO conversation_lease AS held (account_id, conversation_id, run_id, execution_id,
                                            fence, worker_id, device_id, acquired_at)
    VALUES (of_account, of_conversation, run.id, run.claim_token, run.fence, worker, device,
            now)
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
    RETURNING true INTO leased;
    PERFORM require_conversation_lease(coalesce(leased, false), run.id);
    -- Round robin's clock, written by one claimer of the account at a time (as claim_runs).
    IF pg_try_advisory_xact_lock(hashtext('agentd.served ' || of_account), 0) THEN
        UPDATE account a SET last_claimed_at = now WHERE a.id = of_account;
    END IF;
    -- Last, once nothing after it can fail: the conversation list's order.
    UPDATE conversation c SET updated_at = clock_timestamp() WHERE c.id = of_conversation;
    PERFORM pg_notify('agentd_conversation', of_conversation::text);
    RETURN QUERY SELECT queue_cap, slots[1], run.id, question, now, run.claim_token, run.fence,
                        run.lease_expires_at, 3::bigint;
END;
$$;

-- post_turn (sql/021): the enqueue, which writes nothing when it refuses, without a subtransaction.
CREATE OR REPLACE FUNCTION post_turn(of_account uuid, of_conversation uuid, device uuid,
                                     content text,
                          request text, request_hash text, idempotency_key text,
                          default_max_queued integer, worker text, lease_ttl_s float8,
                          default_max_running integer, model_guessed boolean,
                          guessed_model text)
RETURNS TABLE (n bigint, conversation boolean, slot integer, max_queued integer,
               id uuid, status text, user_message_id uuid, created_at timestamptz,
               hints bigint, claim_token uuid, fence bigint, worker_id text,
               lease_expires_at timestamptz, cancel_requested boolean,
               started_at timestamptz, last_seq bigint, transcript jsonb,
               model_changed boolean)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    enqueued record;
    claimed record;
    started record;
    direct boolean := false;
    refused boolean := false;
BEGIN
    IF model_guessed AND EXISTS (
            SELECT 1 FROM conversation c
            WHERE c.id = of_conversation AND c.account_id = of_account
              AND c.model IS DISTINCT FROM guessed_model) THEN
        RETURN QUERY SELECT 1::bigint, true, NULL::integer, NULL::integer, NULL::uuid,
                            NULL::text, NULL::uuid, NULL::timestamptz, 0::bigint, NULL::uuid,
                            NULL::bigint, NULL::text, NULL::timestamptz, NULL::boolean,
                            NULL::timestamptz, NULL::bigint, NULL::jsonb, true;
        RETURN;
    END IF;
    IF worker IS NOT NULL AND NOT EXISTS (SELECT 1 FROM agent_run q WHERE q.status = 'queued')
    THEN
        BEGIN
            SELECT * INTO started
            FROM start_posted_turn(of_account, of_conversation, device, content, request,
                                   request_hash, idempotency_key, default_max_queued, worker,
                                   lease_ttl_s, default_max_running);
            direct := started.id IS NOT NULL;
            IF NOT direct THEN
                RAISE EXCEPTION 'the line is not empty';  -- undoes its slot and any row written
            END IF;
        EXCEPTION WHEN raise_exception OR unique_violation OR lock_not_available
                       OR deadlock_detected THEN
            direct := false;
        END;
        IF direct THEN
            RETURN QUERY SELECT 1::bigint, true, started.slot, started.max_queued, started.id,
                                'running'::text, started.user_message_id, started.created_at,
                                1::bigint, started.claim_token, started.fence, worker,
                                started.lease_expires_at, false, started.created_at,
                                started.last_seq,
                                posted_transcript(of_conversation, started.user_message_id),
                                false;
            RETURN;
        END IF;
    END IF;
    SELECT * INTO enqueued
    FROM enqueue_runs(of_account, ARRAY[of_conversation], device, ARRAY[content],
                      ARRAY[request], ARRAY[request_hash], ARRAY[idempotency_key],
                      default_max_queued, worker IS NULL);
    refused := enqueued.id IS NULL;  -- it wrote nothing, and no hint went out
    IF worker IS NOT NULL AND NOT refused THEN
        SELECT * INTO claimed
        FROM claim_runs_beside_enqueue(worker, lease_ttl_s, default_max_running, enqueued.id);
        IF claimed.id IS NOT NULL THEN
            RETURN QUERY SELECT enqueued.n, enqueued.conversation, enqueued.slot,
                                enqueued.max_queued, enqueued.id, 'running'::text,
                                enqueued.user_message_id, enqueued.created_at, enqueued.hints,
                                claimed.claim_token, claimed.fence, claimed.worker_id,
                                claimed.lease_expires_at, claimed.cancel_requested,
                                claimed.started_at, claimed.last_seq,
                                posted_transcript(of_conversation, enqueued.user_message_id),
                                false;
            RETURN;
        END IF;
        PERFORM pg_notify('agentd_run_enqueued', of_conversation::text);
    END IF;
    RETURN QUERY SELECT enqueued.n, enqueued.conversation, enqueued.slot, enqueued.max_queued,
                        enqueued.id, enqueued.status, enqueued.user_message_id,
                        enqueued.created_at, enqueued.hints, NULL::uuid, NULL::bigint,
                        NULL::text, NULL::timestamptz, NULL::boolean, NULL::timestamptz,
                        NULL::bigint, NULL::jsonb, false;
END;
$$;

-- Steps 1-4 of claim_runs (sql/011), which write nothing: the turns a claim would start now,
-- their running slots and the accounts whose round-robin clock it may move. The rows are locked
-- (FOR UPDATE SKIP LOCKED) and the slots held (advisory locks) for the transaction.
CREATE FUNCTION pick_claimable_runs(want integer, default_max_running integer,
                                    OUT admitted uuid[], OUT admitted_slots integer[],
                                    OUT served_accounts uuid[])
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
    n integer;
BEGIN
    admitted := '{}';
    admitted_slots := '{}';
    served_accounts := '{}';
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
END;
$$;

-- The fair claim (sql/011), now the pick and the write (start_claimed_runs, step 5) in turn.
CREATE OR REPLACE FUNCTION claim_runs(worker text, lease_ttl_s float8, want integer,
                                      default_max_running integer)
RETURNS TABLE (id uuid, account_id uuid, conversation_id uuid, user_message_id uuid,
               origin_device_id uuid, request jsonb, claim_token uuid, fence bigint,
               worker_id text, lease_expires_at timestamptz, cancel_requested boolean,
               created_at timestamptz, started_at timestamptz, last_seq bigint)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    picked record;
BEGIN
    SELECT * INTO picked FROM pick_claimable_runs(want, default_max_running);
    IF cardinality(picked.admitted) = 0 THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM start_claimed_runs(worker, lease_ttl_s, picked.admitted,
                                                  picked.admitted_slots,
                                                  picked.served_accounts);
END;
$$;

-- claim_runs_beside_enqueue (sql/015): the pick first, in the subtransaction, and the write
-- only when the pick is this enqueue's own turn, so a claim that picked another turn has
-- written nothing when it is undone (it used to start that turn, move its account's clock and
-- roll both back). The write stays in the subtransaction: a unique index arbitrating for a
-- rival, a lock timeout or a deadlock still undoes the claim alone. What it writes first is the
-- enqueue's own run, which no other transaction sees yet.
CREATE OR REPLACE FUNCTION claim_runs_beside_enqueue(worker text, lease_ttl_s float8,
                                                     default_max_running integer, own uuid)
RETURNS TABLE (id uuid, account_id uuid, conversation_id uuid, user_message_id uuid,
               origin_device_id uuid, request jsonb, claim_token uuid, fence bigint,
               worker_id text, lease_expires_at timestamptz, cancel_requested boolean,
               created_at timestamptz, started_at timestamptz, last_seq bigint)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    picked record;
    claimed record;
BEGIN
    BEGIN
        SELECT * INTO picked FROM pick_claimable_runs(1, default_max_running);
        IF picked.admitted IS DISTINCT FROM ARRAY[own] THEN
            RAISE EXCEPTION 'not this enqueue''s turn';  -- releases what the pick locked
        END IF;
        SELECT * INTO claimed
        FROM start_claimed_runs(worker, lease_ttl_s, picked.admitted, picked.admitted_slots,
                                picked.served_accounts);
    EXCEPTION WHEN raise_exception OR unique_violation OR lock_not_available
                   OR deadlock_detected THEN
        RETURN;
    END;
    RETURN QUERY SELECT claimed.id, claimed.account_id, claimed.conversation_id,
                        claimed.user_message_id, claimed.origin_device_id, claimed.request,
                        claimed.claim_token, claimed.fence, claimed.worker_id,
                        claimed.lease_expires_at, claimed.cancel_requested, claimed.created_at,
                        claimed.started_at, claimed.last_seq;
END;
$$;

-- start_claimed_runs (sql/011, step 5 of the claim): the account's round-robin clock moved last.
CREATE OR REPLACE FUNCTION start_claimed_runs(worker text, lease_ttl_s float8, admitted uuid[],
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
    -- Round robin's clock: the accounts served now go to the back of the line. After every
    -- step that can fail (the lease's lock, its guard), so an undone claim beside an enqueue
    -- never wrote the account's row (sql/022).
    UPDATE account a SET last_claimed_at = now WHERE a.id = ANY (served_accounts);
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
