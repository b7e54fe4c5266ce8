-- A claim whose answer is lost can be found again.
--
-- A claim commits, then the connection breaks before its answer arrives (PostgreSQL restarted,
-- a proxy dropped the link). The claimer never learns which runs it took: they stay running
-- under its name with nobody executing them, and the reaper fails them once their lease runs
-- out (`lease_expired`, about 35 s later). A turn that never began was lost to a broken wire.
--
-- Now the claimer chooses a key for each claim statement, and every run that statement claims
-- gets the claim token claim_token_for(key, run). A claimer whose answer was lost asks for the
-- runs still running under its worker name whose token that key gives
-- (queries.sql, runs_claimed_with_key), and executes them as if the answer had come. Nothing
-- else changes: the token is still unique to one claim of one run (a run is claimed at most
-- once, and a new key is chosen for every statement), and every fenced write compares it as
-- before. The functions that write a claim token take the key as their last parameter:
-- start_claimed_runs, claim_runs, claim_runs_beside_enqueue, start_posted_turn and post_turn,
-- redefined here from sql/022 with that one change (and start_posted_turn choosing its run's
-- id itself, which the token needs). A claim without a key is refused: its runs would hold no
-- token, and no fenced write could ever succeed.

-- The claim token of `run` claimed by a statement whose claimer chose `claim_key`. sha256, not
-- md5: md5 is refused by PostgreSQL builds in FIPS mode. PL/pgSQL like every function of the
-- schema (sql/020).
CREATE FUNCTION claim_token_for(claim_key uuid, run uuid) RETURNS uuid
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    RETURN encode(substring(sha256(convert_to(claim_key::text || run::text, 'UTF8'))
                            FROM 1 FOR 16), 'hex')::uuid;
END;
$$;

DROP FUNCTION post_turn(uuid, uuid, uuid, text, text, text, text, integer, text, float8, integer,
                        boolean, text);
DROP FUNCTION start_posted_turn(uuid, uuid, uuid, text, text, text, text, integer, text, float8,
                                integer);
DROP FUNCTION claim_runs_beside_enqueue(text, float8, integer, uuid);
DROP FUNCTION claim_runs(text, float8, integer, integer);
DROP FUNCTION start_claimed_runs(text, float8, uuid[], integer[], uuid[]);

-- start_claimed_runs (sql/022): each run's token from the claim's key.
CREATE FUNCTION start_claimed_runs(worker text, lease_ttl_s float8, admitted uuid[],
                                   admitted_slots integer[], served_accounts uuid[],
                                   claim_key uuid)
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
    IF claim_key IS NULL THEN
        RAISE EXCEPTION 'a claim needs a key' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    WITH claimed AS (
        UPDATE agent_run r
        SET status = 'running',
            claim_token = claim_token_for(claim_key, r.id),
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

-- claim_runs (sql/022): the key passed to the write.
CREATE FUNCTION claim_runs(worker text, lease_ttl_s float8, want integer,
                           default_max_running integer, claim_key uuid)
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
                                                  picked.served_accounts, claim_key);
END;
$$;

-- claim_runs_beside_enqueue (sql/022): the key passed to the write.
CREATE FUNCTION claim_runs_beside_enqueue(worker text, lease_ttl_s float8,
                                          default_max_running integer, own uuid,
                                          claim_key uuid)
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
                                picked.served_accounts, claim_key);
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

-- start_posted_turn (sql/022): its run's id chosen first, its token from the key.
CREATE FUNCTION start_posted_turn(of_account uuid, of_conversation uuid, device uuid,
                                  content text, request text, request_hash text,
                                  idempotency_key text, default_max_queued integer,
                                  worker text, lease_ttl_s float8, default_max_running integer,
                                  claim_key uuid)
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
    turn uuid := gen_random_uuid();
    run record;
    leased boolean;
BEGIN
    IF claim_key IS NULL THEN
        RAISE EXCEPTION 'a claim needs a key' USING ERRCODE = 'null_value_not_allowed';
    END IF;
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
    INSERT INTO agent_run AS r (id, account_id, conversation_id, user_message_id, origin_device_id,
                                request, request_hash, idempotency_key, created_at, slot,
                                status, claim_token, fence, worker_id, lease_expires_at,
                                last_heartbeat_at, started_at)
    VALUES (turn, of_account, of_conversation, question, device, request::jsonb, request_hash,
            idempotency_key, now, slots[1], 'running', claim_token_for(claim_key, turn),
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

-- post_turn (sql/022): the key passed to both ways of starting the turn.
CREATE FUNCTION post_turn(of_account uuid, of_conversation uuid, device uuid, content text,
                          request text, request_hash text, idempotency_key text,
                          default_max_queued integer, worker text, lease_ttl_s float8,
                          default_max_running integer, model_guessed boolean,
                          guessed_model text, claim_key uuid)
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
                                   lease_ttl_s, default_max_running, claim_key);
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
        FROM claim_runs_beside_enqueue(worker, lease_ttl_s, default_max_running, enqueued.id,
                                       claim_key);
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
