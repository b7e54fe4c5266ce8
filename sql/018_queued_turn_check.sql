-- A dispatchers' wake goes out only while its conversation's account has a turn queued
-- (notify_batch in queries.sql). The check moves into a function of its own, so that the
-- statement sending the hints is cheap to plan.
--
-- PostgreSQL planned notify_batch afresh at every call (its cached generic plan never won the
-- cost comparison against a plan made for the call's arrays) and spent 0.33-0.45 ms doing so,
-- nearly all of it on the check's subquery, against 0.02-0.04 ms of executing it. Inside a
-- PL/pgSQL function the check's plan is cached per session: its one parameter is a key, for
-- which the generic plan costs what a custom one would.
--
-- The account's newest queued turn is looked for: the oldest entries of its queued-turn index
-- are the turns just claimed, dead until vacuum, and a busy account has many (looking oldest
-- first cost 1.2 ms a statement under load; newest first 0.13 ms).
CREATE FUNCTION account_has_queued_turn(of_conversation uuid)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (
        SELECT 1 FROM conversation c
        CROSS JOIN LATERAL (
            SELECT 1 FROM agent_run q
            WHERE q.account_id = c.account_id AND q.status = 'queued'
            ORDER BY q.created_at DESC, q.id DESC
            LIMIT 1) newest
        WHERE c.id = of_conversation);
END;
$$;
