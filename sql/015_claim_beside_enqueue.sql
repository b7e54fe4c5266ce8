-- A claim made inside an enqueue's own transaction (dispatcher.Dispatcher.reserve), so a turn
-- posted to a process with a free slot starts in the commit that wrote it: one synchronous commit
-- and two round trips fewer before its first token than a claim sent after the enqueue commits.
--
-- The claim is optional there and the enqueue is not: losing a race (a unique index arbitrated
-- for another claimer), a lock not granted within lock_timeout, or being chosen as a deadlock's
-- victim rolls back the claim alone (the exception block is a subtransaction) and answers no
-- rows, so the enqueue still commits and the dispatcher claims the turn as it would have.
-- claim_runs answers its rows only once it has finished (a PL/pgSQL function's rows are
-- materialized when it returns), so an error can never leave half a claim in the answer.
CREATE FUNCTION claim_runs_beside_enqueue(worker text, lease_ttl_s float8, want integer,
                                          default_max_running integer)
RETURNS TABLE (id uuid, account_id uuid, conversation_id uuid, user_message_id uuid,
               origin_device_id uuid, request jsonb, claim_token uuid, fence bigint,
               worker_id text, lease_expires_at timestamptz, cancel_requested boolean,
               created_at timestamptz, started_at timestamptz, last_seq bigint)
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN QUERY SELECT * FROM claim_runs(worker, lease_ttl_s, want, default_max_running);
EXCEPTION WHEN unique_violation OR lock_not_available OR deadlock_detected THEN
    RETURN;
END;
$$;
