-- A post of one turn in ONE statement: the enqueue, the claim beside it and, for a turn left
-- queued, the dispatchers' wake; for a turn started, the transcript its executor would read
-- next. Before, the daemon sent BEGIN, the enqueue, the claim and COMMIT, then the executor
-- its first read: five round trips, each a wake-up of the server's process and of the
-- daemon's, on the way to every turn's first token (docs/benchmarks.md, "Eleventh round").
--
-- The enqueue moves from queries.sql into a function, unchanged, so that both the many-turn
-- enqueue (queries.sql, enqueue_runs) and the one-statement post run the same statement; its
-- plan is cached per session like any PL/pgSQL statement's.

-- For each turn asked, the user message, the run, journal seq 1-2 and the wake, in ONE
-- statement with every other turn of the call (a run is a row: docs/architecture.md rule 1).
-- Turns are numbered by their place in the arrays; the answer has one row per turn.
-- Each conversation is updated first (its updated_at, the conversation list's order), which
-- also locks it: runs of one conversation get created_at in commit order (a conversation feed's
-- watermark relies on it), on_busy checks serialize with us, and turns of one conversation are
-- inserted in the order asked. The row is touched once, lock and update in one step: locking it
-- and updating it later in the statement deadlocked enqueues into one conversation (the update
-- went back to the version the statement began with, where a rival was queued waiting for us;
-- tests/integration/test_enqueue.py). So a post that creates no turn (a full queue, a replayed
-- key) moves updated_at too, unless the caller rolls it back (post_turn does). A call naming several
-- conversations locks them in the order the plan meets them, and two such calls can deadlock;
-- the daemon's calls name one.
-- Bounded: the call takes distinct free queue slots of its account for its turns at once
-- (take_queue_slots, sql/012), so no race can overshoot max_queued (default_max_queued when
-- the account sets none), enqueues of one account never wait for each other, and no insert is
-- turned away for its slot; a turn whose idempotency key is taken already needs none. ON
-- CONFLICT DO NOTHING: a repeated idempotency key inserts nothing (a unique index arbitrates,
-- even mid-flight). The answer says which: `conversation` false = no such conversation here;
-- `slot` NULL = no free slot (the queue is full) or a key already used; `id` NULL with a slot =
-- its key was used meanwhile (earlier in this call, or by a rival that committed first).
-- The wake: the conversation's feeds always; the dispatchers unless wake_dispatchers is false,
-- for a caller that claims beside the enqueue and wakes them itself only if the turn is left
-- queued: a turn started there needs no claim loop.
CREATE FUNCTION enqueue_runs(of_account uuid, conversation_ids uuid[], device uuid,
                             contents text[], requests text[], request_hashes text[],
                             idempotency_keys text[], default_max_queued integer,
                             wake_dispatchers boolean)
RETURNS TABLE (n bigint, conversation boolean, slot integer, max_queued integer, id uuid,
               status text, user_message_id uuid, created_at timestamptz, hints bigint)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH item AS (
        SELECT i.*
        FROM unnest(conversation_ids, contents, requests, request_hashes, idempotency_keys)
            WITH ORDINALITY AS i (conversation_id, content, request, request_hash,
                                  idempotency_key, n)
    ), conv AS (
        UPDATE conversation c SET updated_at = clock_timestamp()
        FROM account a
        WHERE a.id = c.account_id AND c.id = ANY (conversation_ids) AND c.account_id = of_account
        RETURNING c.id, c.account_id, coalesce(a.max_queued, default_max_queued) AS max_queued
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

-- One turn posted, in one statement and so in one transaction and one commit: enqueued, and,
-- when the posting process holds a free slot for it (`worker` is not NULL), claimed beside its
-- enqueue (sql/015: kept only when the fair claim picks this very turn). A turn left queued
-- (no slot, the claim picked another, lost a race, or the account is at its running limit)
-- wakes the claim loops of every process in the same commit. The enqueue's answer comes with the
-- claim's columns and the transcript the turn's model reads first (what open_turn in queries.sql
-- reads, one JSON object per message), NULL when the turn was not claimed here: the executor
-- then starts without a read of its own.
-- A post that writes no turn (no such conversation, a full queue, a key used already) changes
-- nothing: the enqueue runs in a subtransaction, rolled back then, so the conversation's
-- updated_at (the enqueue's lock on its row) does not move for a refused post.
CREATE FUNCTION post_turn(of_account uuid, of_conversation uuid, device uuid, content text,
                          request text, request_hash text, idempotency_key text,
                          default_max_queued integer, worker text, lease_ttl_s float8,
                          default_max_running integer)
RETURNS TABLE (n bigint, conversation boolean, slot integer, max_queued integer,
               id uuid, status text, user_message_id uuid, created_at timestamptz,
               hints bigint, claim_token uuid, fence bigint, worker_id text,
               lease_expires_at timestamptz, cancel_requested boolean,
               started_at timestamptz, last_seq bigint, transcript jsonb)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    enqueued record;
    claimed record;
    refused boolean := false;
BEGIN
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
                                (SELECT jsonb_agg(jsonb_build_object(
                                            'role', t.role, 'content', t.content,
                                            'tool_calls', t.tool_calls,
                                            'tool_call_id', t.tool_call_id) ORDER BY t.ordinality)
                                 FROM turn_transcript(of_conversation, enqueued.user_message_id)
                                     WITH ORDINALITY AS t);
            RETURN;
        END IF;
        PERFORM pg_notify('agentd_run_enqueued', of_conversation::text);
    END IF;
    RETURN QUERY SELECT enqueued.n, enqueued.conversation, enqueued.slot, enqueued.max_queued,
                        enqueued.id, enqueued.status, enqueued.user_message_id,
                        enqueued.created_at, enqueued.hints, NULL::uuid, NULL::bigint,
                        NULL::text, NULL::timestamptz, NULL::boolean, NULL::timestamptz,
                        NULL::bigint, NULL::jsonb;
END;
$$;
