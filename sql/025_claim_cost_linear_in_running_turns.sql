-- A claim's cost grows with the account's running turns, not with their square.
--
-- bench/claim_cost.py (docs/benchmarks.md, "Twenty-first look"): with 1,000 turns of one
-- account running, a claim of one turn took 6.8-7.3 ms, most of it the server's CPU, and 2.1-2.7
-- ms after this. Two statements did work in proportion to a product:
--
-- * take_running_slots listed the free slots among 1..least(cap, running + 2 * want + 32) with
--   `g <> ALL (taken)`, which compares every candidate with every running turn's slot: a
--   million comparisons at 1,000 running. EXCEPT finds them with one hash.
-- * The pick skipped a queued turn whose conversation runs a turn with NOT EXISTS per
--   candidate. The planner could answer it with agent_run_running_slot (account, slot), whose
--   predicate (status = 'running') matches too, by scanning that whole index for each
--   candidate, the entries of turns that ended since the last vacuum and of turns a rival is
--   starting included: the estimate of running rows is small after a quiet moment, so the
--   plan looked cheap. The account's running conversations are now read once per claim into
--   a hashed set (10,000 running turns, an account's most, hash in well under work_mem; a
--   set too large to hash would be scanned per candidate again). The account's alone: a
--   turn's conversation belongs to its account (agent_run_conversation_account_fkey). As
--   before, this only filters; the index one_running_per_conversation is what keeps one
--   running turn per conversation.

-- take_running_slots (sql/011), the free slots found by set difference.
CREATE OR REPLACE FUNCTION take_running_slots(of_account uuid, cap integer, want integer)
RETURNS integer[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    key integer := hashtext('agentd.running ' || of_account);
    taken integer[];
    wanted integer;
    got integer[] := '{}';
BEGIN
    taken := ARRAY(SELECT r.slot FROM agent_run r
                   WHERE r.account_id = of_account AND r.status = 'running');
    IF want < 1 OR cardinality(taken) >= cap
       OR EXISTS (SELECT 1 FROM unnest(taken) t WHERE t > cap) THEN
        RETURN got;
    END IF;
    FOR wanted IN
        SELECT f.slot FROM (
            SELECT g FROM generate_series(1, least(cap, cardinality(taken) + 2 * want + 32)) g
            EXCEPT
            SELECT t FROM unnest(taken) t) f (slot)
        ORDER BY random()
    LOOP
        IF pg_try_advisory_xact_lock(key, wanted) THEN
            got := got || wanted;
            EXIT WHEN cardinality(got) = want;
        END IF;
    END LOOP;
    RETURN got;
END;
$$;

-- pick_claimable_runs (sql/022), the busy conversations read once.
CREATE OR REPLACE FUNCTION pick_claimable_runs(want integer, default_max_running integer,
                                    OUT admitted uuid[], OUT admitted_slots integer[],
                                    OUT served_accounts uuid[])
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    accounts uuid[];
    caps integer[];
    left_over integer := want;
    share integer;
    slots integer[];
    picked uuid[];
    n integer;
BEGIN
    admitted := '{}';
    admitted_slots := '{}';
    served_accounts := '{}';
    IF want < 1 THEN
        RETURN;
    END IF;
    -- 1
    SELECT array_agg(acc.id ORDER BY acc.last_claimed_at NULLS FIRST, acc.id),
           array_agg(coalesce(acc.max_running, default_max_running)
                     ORDER BY acc.last_claimed_at NULLS FIRST, acc.id)
    INTO accounts, caps
    FROM (
        WITH RECURSIVE queued_accounts AS (
            (SELECT q.account_id FROM agent_run q WHERE q.status = 'queued'
             ORDER BY q.account_id LIMIT 1)
            UNION ALL
            SELECT (SELECT q.account_id FROM agent_run q
                    WHERE q.status = 'queued' AND q.account_id > seen.account_id
                    ORDER BY q.account_id LIMIT 1)
            FROM queued_accounts seen
            WHERE seen.account_id IS NOT NULL
        )
        SELECT qa.account_id FROM queued_accounts qa WHERE qa.account_id IS NOT NULL
    ) qa
    JOIN account acc ON acc.id = qa.account_id;
    n := coalesce(cardinality(accounts), 0);
    FOR i IN 1..n LOOP
        EXIT WHEN left_over = 0;
        -- 2: an even share of what is left, to the accounts not yet served in this claim
        share := ceil(left_over::numeric / (n - i + 1))::integer;
        -- 4 (before 3, so an account at its limit locks none of its turns)
        slots := take_running_slots(accounts[i], caps[i], share);
        CONTINUE WHEN cardinality(slots) = 0;
        -- 3
        picked := ARRAY(
            SELECT q.id FROM agent_run q
            WHERE q.account_id = accounts[i] AND q.status = 'queued'
              AND q.conversation_id NOT IN (
                  SELECT busy.conversation_id FROM agent_run busy
                  WHERE busy.account_id = accounts[i] AND busy.status = 'running')
              AND q.id = (
                  SELECT head.id FROM agent_run head
                  WHERE head.conversation_id = q.conversation_id AND head.status = 'queued'
                  ORDER BY head.created_at, head.id
                  LIMIT 1)
            ORDER BY q.created_at, q.id
            LIMIT cardinality(slots)
            FOR UPDATE SKIP LOCKED);
        CONTINUE WHEN cardinality(picked) = 0;
        admitted := admitted || picked;
        admitted_slots := admitted_slots || slots[1:cardinality(picked)];
        left_over := left_over - cardinality(picked);
        -- Round robin's clock is written by one claimer of the account at a time; a rival
        -- writing it now writes the same moment, so we leave it to them rather than wait.
        IF pg_try_advisory_xact_lock(hashtext('agentd.served ' || accounts[i]), 0) THEN
            served_accounts := served_accounts || accounts[i];
        END IF;
    END LOOP;
END;
$$;
