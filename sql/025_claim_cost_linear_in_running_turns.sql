-- A claim's running slots are found in time that grows with the account's running turns, not
-- with their square.
--
-- bench/claim_cost.py (docs/benchmarks.md, "Twenty-first look"): with 1,000 turns of one
-- account running, a claim of one turn took 6.8-7.3 ms, most of it the server's CPU, and 2.1-2.7
-- ms after this and sql/026 (which reads the account's busy conversations once per claim).
-- take_running_slots listed the free slots among 1..least(cap, running + 2 * want + 32) with
-- `g <> ALL (taken)`, which compares every candidate with every running turn's slot: a million
-- comparisons at 1,000 running. EXCEPT finds them with one hash.

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
