-- A claim's pick reads the running turns once, and passes by the accounts that have nothing
-- they could start.
--
-- Two parts of pick_claimable_runs (sql/022) did work in proportion to a product
-- (bench/claim_cost.py, docs/benchmarks.md, "Twenty-first look"):
--
-- * The busy conversations. The pick skipped a queued turn whose conversation runs a turn with
--   NOT EXISTS per candidate. The planner could answer it with agent_run_running_slot (account,
--   slot), whose predicate (status = 'running') matches too, by scanning that whole index for
--   each candidate, the entries of turns that ended since the last vacuum and of turns a rival
--   is starting included: the estimate of running rows is small after a quiet moment, so the
--   plan looked cheap. The account's running conversations are now read once per claim into a
--   hashed set. The account's alone: a turn's conversation belongs to its account
--   (agent_run_conversation_account_fkey). As before, this only filters; the index
--   one_running_per_conversation is what keeps one running turn per conversation.
-- * The accounts that cannot start a turn. A claim walks the accounts with a queued turn,
--   round robin. For each it listed the account's running slots, took some (advisory locks) and
--   only then looked for a turn, though a turn queued behind its conversation's running turn
--   cannot start (a chat's follow-up sent while the answer streams). Beside 500 accounts each
--   with one such turn, a claim that found nothing took 19-27 ms, nearly all of it the server's
--   CPU (40-50 us an account), and every claim loop's wake paid it. The list of accounts now
--   keeps only those with a queued turn in a conversation that runs none: the listed accounts'
--   running conversations are read once into a hashed set, then each account is checked by its
--   own index entries, stopping at its first such turn. The turns are still picked only under a
--   running slot, with SKIP LOCKED, as before: a rival's locked turn passes this check and is
--   skipped by the pick. The check reads the list's snapshot, taken before the pick's: a running
--   turn that ends between the two leaves its follow-up for the next claim, which the ending's
--   wake brings (notifier.py).
--
-- Both sets hash in well under work_mem at 10,000 running turns, an account's most; a set too
-- large to hash would be scanned per candidate or per account instead.

-- pick_claimable_runs (sql/022), with the list checked and the busy conversations read once.
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
        ), listed AS MATERIALIZED (
            SELECT qa.account_id FROM queued_accounts qa WHERE qa.account_id IS NOT NULL
        )
        SELECT l.account_id FROM listed l
        -- Only an account with a queued turn in a conversation that runs none can start one.
        -- A lone account is not checked: the loop below finds out as cheaply, and the check
        -- would read its running turns once more (three times in all, with its slots' list and
        -- the pick's own check).
        WHERE (SELECT count(*) FROM listed) < 2 OR EXISTS (
            SELECT 1 FROM agent_run q
            WHERE q.account_id = l.account_id AND q.status = 'queued'
              AND q.conversation_id NOT IN (
                  SELECT busy.conversation_id FROM agent_run busy
                  WHERE busy.status = 'running'
                    AND busy.account_id IN (SELECT listed.account_id FROM listed))
            -- Checked account by account, each stopping at its first such turn: without the
            -- fence the planner may hash every queued turn of the fleet instead.
            OFFSET 0)
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
