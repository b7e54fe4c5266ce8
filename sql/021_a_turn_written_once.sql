-- A turn posted into an empty line is written once, already running.
--
-- Before, a post with a free slot of its process inserted the turn queued (the run, its question
-- message `queued`, journal seq 1-2, a queue slot) and then, in the same statement, ran the fair
-- claim (sql/015), which picked that very turn and rewrote it: the run again (7 index entries),
-- the question again (`complete`), and the claim function's own steps. Both versions committed
-- together, so no reader ever saw the first one. PostgreSQL spent about 2.7 ms of server time
-- on such a post here, 1.2 ms of it in the claim (docs/benchmarks.md, "Twelfth round").
--
-- When the fair claim can only pick this turn, the post now writes what the claim would have
-- left: the run `running` with its claim token, fence, lease and a running slot, the question
-- `complete`, journal seq 1-3 (user_message, run_queued, run_started), the conversation lease
-- and the account's round-robin clock. Readers see exactly the rows the enqueue and the claim
-- committed before. The fair claim can only pick it when, under the conversation's lock:
--   * no turn is queued at all, in any account (any other would compete for the claim);
--   * its conversation runs no turn (one turn at a time per conversation);
--   * its account has a free running slot (max_running) and room for one queued turn
--     (max_queued: a post the enqueue would refuse is not started either);
--   * its Idempotency-Key, if any, is unused (a replay is the enqueue's answer).
-- Anything else leaves it to the enqueue and the claim beside it, as before.

-- The direct start, or no row when the line is not empty (the caller then rolls back what this
-- wrote: the conversation's updated_at, the lock taken with it). The conversation is locked
-- FIRST and the line checked after, in statements of their own (each sees what committed before
-- it): a rival post into the same conversation, holding its lock, is seen once it commits, so
-- turns of one conversation still start in the order they were posted. Every unique index
-- still arbitrates (ON CONFLICT DO NOTHING answers no row): the key, the running slot, one
-- running turn per conversation.
CREATE FUNCTION start_posted_turn(of_account uuid, of_conversation uuid, device uuid,
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
    UPDATE conversation c SET updated_at = clock_timestamp()
    FROM account a
    WHERE a.id = c.account_id AND c.id = of_conversation AND c.account_id = of_account
    RETURNING coalesce(a.max_queued, default_max_queued),
              coalesce(a.max_running, default_max_running)
    INTO queue_cap, run_cap;
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
    PERFORM pg_notify('agentd_conversation', of_conversation::text);
    RETURN QUERY SELECT queue_cap, slots[1], run.id, question, now, run.claim_token, run.fence,
                        run.lease_expires_at, 3::bigint;
END;
$$;

-- What the model of a turn started by a post reads first: open_turn's transcript (queries.sql),
-- one JSON object per message, answered with the post so the executor starts without a read.
CREATE FUNCTION posted_transcript(of_conversation uuid, question uuid) RETURNS jsonb
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT jsonb_agg(jsonb_build_object('role', t.role, 'content', t.content,
                                                'tool_calls', t.tool_calls,
                                                'tool_call_id', t.tool_call_id)
                             ORDER BY t.ordinality)
            FROM turn_transcript(of_conversation, question) WITH ORDINALITY AS t);
END;
$$;

-- post_turn (sql/019) tries the direct start first, in a subtransaction rolled back when the
-- line is not empty, and only then the enqueue and the claim beside it. The check that nothing
-- is queued runs once before, without a lock: on a busy queue, where the direct start cannot
-- apply, a post pays one index probe for it, not a conversation update undone.
--
-- It also checks the model a request was built for. A post that names no model runs on its
-- conversation's, which the daemon used to read in a round trip of its own before posting; it
-- now builds the request on the model it last saw the conversation with (service.py) and says
-- so (`model_guessed`, `guessed_model`): if the conversation's model is another one now, the
-- post writes nothing and answers `model_changed`, and the daemon reads the conversation and
-- posts again. Read in this statement, the model is as fresh as that separate read was (a
-- change committed after it, while the post is under way, applies from the next post on).
DROP FUNCTION post_turn(uuid, uuid, uuid, text, text, text, text, integer, text, float8,
                        integer);
CREATE FUNCTION post_turn(of_account uuid, of_conversation uuid, device uuid, content text,
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
                RAISE EXCEPTION 'the line is not empty';  -- undoes the conversation's update
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
    BEGIN
        SELECT * INTO enqueued
        FROM enqueue_runs(of_account, ARRAY[of_conversation], device, ARRAY[content],
                          ARRAY[request], ARRAY[request_hash], ARRAY[idempotency_key],
                          default_max_queued, worker IS NULL);
        IF enqueued.id IS NULL THEN
            refused := true;
            RAISE EXCEPTION 'no turn written';  -- undoes the conversation's updated_at
        END IF;
    EXCEPTION WHEN raise_exception THEN
        IF NOT refused THEN
            RAISE;
        END IF;
        -- PL/pgSQL variables keep what they held when the block was rolled back: the answer
        -- below says why nothing was written (and that no hint went out).
    END;
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
