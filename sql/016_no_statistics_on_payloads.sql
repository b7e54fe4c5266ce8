-- No planner statistics for the payload columns, which no statement filters, joins or sorts on.
--
-- ANALYZE sorts a sample of every column to find its common values and histogram; for a jsonb
-- column that means comparing thousands of JSON documents. The journal's payloads, a run's
-- request and usage and a message's tool calls are only ever read back whole (or, for tool
-- calls, matched inside one turn's rows), so their statistics informed no plan. While the hot
-- tables are young agentd analyzes them each time they double (statistics.py): measured on a
-- journal of 46,300 rows, ANALYZE run_event went from 128-198 ms to 59-65 ms and ANALYZE
-- agent_run from 70-112 ms to 45-50 ms. Message text keeps its statistics: the conversation
-- search filters on it.
ALTER TABLE run_event ALTER COLUMN payload SET STATISTICS 0;
ALTER TABLE agent_run ALTER COLUMN request SET STATISTICS 0,
    ALTER COLUMN usage SET STATISTICS 0;
ALTER TABLE message ALTER COLUMN tool_calls SET STATISTICS 0;
