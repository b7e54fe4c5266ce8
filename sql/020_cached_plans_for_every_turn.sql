-- The functions written in SQL, unchanged in what they do, now in PL/pgSQL, whose plans are
-- cached per session. PostgreSQL plans the query of a SQL function afresh at every call unless
-- it can inline the function into its caller, which it cannot for any of these: one is called
-- WITH ORDINALITY, one writes, one aggregates. Two of them every turn calls. Measured on one session (pg_stat_user_functions, 200-260 turns):
-- turn_transcript 0.44 → 0.08 ms a call, answer_open_tool_calls 0.32 ms a call, nearly all of it
-- planning (docs/benchmarks.md, "Eleventh round").

-- What the model sees for a turn (sql/011): read by a turn's first statement (open_turn), by
-- a post that starts its turn (post_turn, sql/019) and by transcript_for_run. RETURN QUERY hands
-- the rows back in the query's order, which WITH ORDINALITY numbers.
CREATE OR REPLACE FUNCTION turn_transcript(of_conversation uuid, question uuid)
RETURNS TABLE (role text, content text, tool_calls jsonb, tool_call_id text)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY
    SELECT m.role, m.content, m.tool_calls, m.tool_call_id
    FROM message m
    LEFT JOIN agent_run r ON r.id = m.run_id
    LEFT JOIN message asked ON asked.id = r.user_message_id
    WHERE m.conversation_id = of_conversation
      AND coalesce(asked.position, m.position)
          <= (SELECT q.position FROM message q WHERE q.id = question)
      AND m.status NOT IN ('queued', 'draft') AND m.superseded_by IS NULL
    ORDER BY coalesce(asked.position, m.position), m.position;
END;
$$;

-- The tool-call repair (sql/004), called by every terminal write (finish_runs, sql/011) and by
-- the executor before one: every tool call of the run that has no result message yet gets a
-- `cancelled` one, in call order. Idempotent; returns how many calls it answered. Callers fence
-- it (only the run's owner, or the finalizer that just fenced the owner out).
CREATE OR REPLACE FUNCTION answer_open_tool_calls(of_run uuid) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    answered_calls bigint;
BEGIN
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
    SELECT count(*) INTO answered_calls FROM answered;
    RETURN answered_calls;
END;
$$;

-- The text a run's journal holds (sql/008), read whenever a run ends `failed`.
CREATE OR REPLACE FUNCTION journal_text(of_run uuid) RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT coalesce(string_agg(e.payload ->> 'delta', '' ORDER BY e.seq), '')
            FROM run_event e
            WHERE e.run_id = of_run AND e.type = 'content_delta');
END;
$$;
