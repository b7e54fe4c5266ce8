-- Planner statistics for the hot tables that are due, not for all of them at once.
--
-- Before: statistics.py ran one ANALYZE over every hot table whenever any one of them was due.
-- A table that stays small but changes all the time (conversation: every enqueue moves its
-- updated_at) was due every few seconds, and each time it took the large ones along: seen in
-- the benchmarks as an ANALYZE of 200-550 ms every two seconds, 10-15% of the server's CPU.
-- Now each table is analyzed when it is due itself. ANALYZE takes no parameters, hence a
-- function that quotes each name; its caller passes names of the hot tables only.

CREATE FUNCTION analyze_tables(tables text[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY tables LOOP
        EXECUTE format('ANALYZE %I', name);
    END LOOP;
END;
$$;
