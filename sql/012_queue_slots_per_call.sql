-- Queue slots for all the turns of one enqueue call at once, each checked as it is taken.
--
-- Before (sql/011): each turn of a call picked its own slot. An advisory lock is re-entrant
-- within a transaction, so two turns of one call could lock the same slot; and a slot a rival
-- had filled and committed was only found out when the insert was turned away. Either way the
-- turn was retried in a later statement, after turns asked after it had been created: turns of
-- one conversation enqueued together could run out of order.
--
-- Now one call takes distinct slots for all its turns, and checks each slot after locking it
-- with a snapshot taken after the lock (a committed holder is seen; one still in flight holds
-- the lock), so the insert is never turned away for its slot: every turn of a call is created
-- in one statement, in the order asked.

-- Up to `want` distinct free queue slots of the account, each locked for this transaction
-- and checked free: first picks at random in 1..cap (a queue far from full has them at once,
-- and rival enqueuers rarely meet), then the free slots in order. Fewer than `want` means the
-- queue is full (but for slots rivals still in flight hold). A lowered max_queued leaves the
-- turns already queued in place (their slots may lie above it); new ones get slots below it.
CREATE FUNCTION take_queue_slots(of_account uuid, cap integer, want integer)
RETURNS integer[]
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    key integer := hashtext('agentd.queued ' || of_account);
    picks integer := 3 * want;
    got integer[] := '{}';
    free integer[];
    wanted integer;
BEGIN
    IF cap < 1 OR want < 1 THEN
        RETURN got;
    END IF;
    FOR attempt IN 1 .. picks + cap LOOP
        IF attempt <= picks THEN
            wanted := 1 + floor(random() * cap)::integer;
        ELSE
            -- The random picks fell short: the free slots in order, listed once. Listing them
            -- costs time in proportion to max_queued, which only a queue near full pays.
            IF free IS NULL THEN
                free := ARRAY(SELECT g FROM generate_series(1, cap) g
                              EXCEPT SELECT r.slot FROM agent_run r
                                     WHERE r.account_id = of_account AND r.status = 'queued'
                              ORDER BY 1);
            END IF;
            EXIT WHEN attempt - picks > cardinality(free);
            wanted := free[attempt - picks];
        END IF;
        -- Locked first (a rival in flight holds it; the lock is re-entrant, hence `got`),
        -- then checked in a statement of its own: a statement's snapshot is taken as it
        -- starts, so only a check that starts after the lock sees a rival that committed
        -- holding the slot and released its lock just before we took it.
        IF wanted <> ALL (got) AND pg_try_advisory_xact_lock(key, wanted) THEN
            IF NOT EXISTS (SELECT 1 FROM agent_run r WHERE r.account_id = of_account
                           AND r.status = 'queued' AND r.slot = wanted) THEN
                got := got || wanted;
                EXIT WHEN cardinality(got) = want;
            END IF;
        END IF;
    END LOOP;
    RETURN got;
END;
$$;

DROP FUNCTION take_queue_slot(uuid, integer, boolean);
