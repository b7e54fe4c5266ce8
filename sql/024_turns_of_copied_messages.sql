-- A message's turn, in one place: the position of the question it belongs to.
--
-- Paging (a page never splits a question from its answer and tool steps) and forks group
-- messages by turn. A run's messages find their question through the run: a queued question
-- may be answered after later ones were asked. A fork's copies belong to no run, so each copy
-- counted as a turn of its own, and a page of a forked conversation could begin with an answer
-- whose question was on the next page (and forking a fork at a tool call left its results
-- behind). The copies are written in turn order, so a copy that is not a question belongs to
-- the question written last before it.
--
-- A view, not a function: its window is computed per conversation, and a caller's
-- `conversation_id = …` is pushed down into it, so it reads only that conversation's rows.
CREATE VIEW message_turn AS
SELECT m.id, m.conversation_id, m.run_id, m.position, m.role, m.content, m.status,
       m.tool_calls, m.tool_call_id, m.created_at, m.superseded_by,
       coalesce(asked.position,
                CASE WHEN m.run_id IS NULL AND m.role <> 'user'
                     THEN max(m.position) FILTER (WHERE m.role = 'user')
                          OVER (PARTITION BY m.conversation_id ORDER BY m.position) END,
                m.position) AS turn_position
FROM message m
LEFT JOIN agent_run r ON r.id = m.run_id
LEFT JOIN message asked ON asked.id = r.user_message_id;
