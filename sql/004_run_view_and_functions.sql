-- Definitions several named statements share, so each rule is written once in SQL.
-- docs/architecture.md lists which statement uses which.

-- A run as readers see it: every column, plus the name of the device that asked for it.
-- Its columns are exactly agentd.conversations.RunRow's fields.
CREATE VIEW agent_run_with_device AS
SELECT r.id, r.account_id, r.conversation_id, r.user_message_id, r.origin_device_id,
       d.name AS origin_device, r.status, r.request, r.idempotency_key, r.worker_id,
       r.claim_token, r.fence, r.lease_expires_at, r.last_heartbeat_at, r.cancel_requested,
       r.error, r.usage, r.created_at, r.started_at, r.finished_at
FROM agent_run r
LEFT JOIN device d ON d.id = r.origin_device_id;

-- The tool-call repair: every tool call of the run that has no result message yet gets a
-- `cancelled` one, in call order, so the next turn's model request is well-formed (a provider
-- rejects an assistant tool call without its answer). Idempotent: a call already answered, by
-- its tool or by an earlier repair, is left alone. Returns how many calls it answered.
-- Callers fence it (only the run's owner, or the finalizer that just fenced the owner out).
CREATE FUNCTION answer_open_tool_calls(of_run uuid) RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    WITH answered AS (
        INSERT INTO message (conversation_id, run_id, role, content, status, tool_call_id)
        SELECT m.conversation_id, m.run_id, 'tool', '{"error": "cancelled"}', 'cancelled',
               call.value ->> 'id'
        FROM message m
        CROSS JOIN LATERAL jsonb_array_elements(m.tool_calls) WITH ORDINALITY AS call
        WHERE m.run_id = of_run AND m.role = 'assistant' AND m.tool_calls IS NOT NULL
          AND NOT EXISTS (SELECT 1 FROM message t
                          WHERE t.run_id = m.run_id AND t.role = 'tool'
                            AND t.tool_call_id = call.value ->> 'id')
        ORDER BY m.position, call.ordinality
        RETURNING 1
    )
    SELECT count(*) FROM answered;
$$;

-- The claim's guard on the conversation lease (docs/architecture.md, rule 5): a claim whose
-- lease UPSERT found a live holder must not commit. Raising aborts the whole claim statement,
-- so no half claim (a run marked running without its lease) can ever be committed. The error
-- is the unique violation it is: a second holder of the lease's (account_id, conversation_id)
-- key, refused; claimers already treat a unique violation as "claimed nothing".
CREATE FUNCTION require_conversation_lease(acquired boolean, run uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF NOT acquired THEN
        RAISE EXCEPTION 'run %: the conversation lease is held by a live execution', run
            USING ERRCODE = 'unique_violation', CONSTRAINT = 'conversation_lease_pkey';
    END IF;
    RETURN true;
END;
$$;
