-- A claim made inside an enqueue's own transaction (dispatcher.Dispatcher.reserve), so a turn
-- posted to a process with a free slot starts in the commit that wrote it: one synchronous commit
-- and two round trips fewer before its first token than a claim sent after the enqueue commits.
--
-- It takes the turn that enqueue wrote, or nothing: the claim is kept only when the fair claim
-- (claim_runs) picks that turn, the common case of an idle queue. Anything else is rolled back
-- with the subtransaction, its locks with it, and the claim loop starts the turns in their order:
-- keeping another conversation's turn would hold that conversation's row share-locked (the
-- lease's foreign key) until the enqueue commits, and enqueues into that conversation were seen
-- to deadlock on it.
--
-- The claim is optional there and the enqueue is not: losing a race (a unique index arbitrated
-- for another claimer), a lock not granted within lock_timeout, or being chosen as a deadlock's
-- victim inside the claim rolls back the claim alone (the exception block is a subtransaction)
-- and answers no rows, so the enqueue still commits.
CREATE FUNCTION claim_runs_beside_enqueue(worker text, lease_ttl_s float8,
                                          default_max_running integer, own uuid)
RETURNS TABLE (id uuid, account_id uuid, conversation_id uuid, user_message_id uuid,
               origin_device_id uuid, request jsonb, claim_token uuid, fence bigint,
               worker_id text, lease_expires_at timestamptz, cancel_requested boolean,
               created_at timestamptz, started_at timestamptz, last_seq bigint)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    claimed record;
BEGIN
    BEGIN
        SELECT * INTO claimed FROM claim_runs(worker, lease_ttl_s, 1, default_max_running);
        IF claimed.id IS DISTINCT FROM own THEN
            RAISE EXCEPTION 'not this enqueue''s turn';  -- undoes the claim, and its locks
        END IF;
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
