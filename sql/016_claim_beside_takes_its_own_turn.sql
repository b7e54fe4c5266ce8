-- A claim beside an enqueue takes the turn that enqueue wrote, or nothing.
--
-- Before (sql/015) it took whatever turn the fair claim picked, possibly another conversation's.
-- Its transaction then held that conversation's row share-locked (the lease's foreign key) until
-- the enqueue committed, and an enqueue into that conversation which had locked the row and went
-- on to update it could deadlock with a second enqueue queued on the same row. Now the claim is
-- kept only when the fair claim picks this enqueue's own turn (the common case: an idle queue);
-- anything else is rolled back with the subtransaction, its locks with it, and the claim loop
-- starts the turn instead. Fairness is untouched: the pick is still the dispatcher's.
DROP FUNCTION claim_runs_beside_enqueue(text, float8, integer, integer);

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
