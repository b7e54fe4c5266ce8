"""Planner statistics of the hot tables while they are young: asked for once a table has
outgrown the figures it was last analyzed with, and not again until it grows as much again."""

from __future__ import annotations

import asyncpg

from agentd import statistics
from agentd.queue import NewRun, enqueue_runs
from tests.integration.helpers import DEFAULT_TIMEOUT_S
from tests.support.daemon import poll_until
from tests.support.factories import new_conversation, new_tenant


async def last_analyzed(pool: asyncpg.Pool) -> object:
    return await pool.fetchval("SELECT coalesce(last_analyze, last_autoanalyze)"
                               " FROM pg_stat_user_tables WHERE relname = 'agent_run'"
                               " AND schemaname = current_schema()")


async def test_a_young_table_is_analyzed_once_it_outgrows_its_statistics(
        pool: asyncpg.Pool) -> None:
    assert await statistics.refresh_if_young(pool) == [], "nothing has changed yet"
    tenant = await new_tenant(pool)
    conversations = [await new_conversation(pool, tenant.account_id) for _ in range(20)]
    runs = [NewRun(conversations[n % 20], f"turn {n}", {"content": "x", "model": "demo"})
            for n in range(statistics.MIN_CHANGES + 10)]
    for start in range(0, len(runs), 100):
        await enqueue_runs(pool, account_id=tenant.account_id, runs=runs[start:start + 100],
                           default_max_queued=10_000)
    # The server publishes a session's counts when its transaction ends (at most every second).
    analyzed = await poll_until(lambda: statistics.refresh_if_young(pool), DEFAULT_TIMEOUT_S,
                                interval=0.2, what="agent_run to be due for statistics")
    assert "agent_run" in analyzed and "run_event" in analyzed
    assert await last_analyzed(pool) is not None
    reltuples = await pool.fetchval("SELECT reltuples FROM pg_class WHERE relname = 'agent_run'"
                                    " AND relnamespace = current_schema()::regnamespace")
    assert reltuples >= statistics.MIN_CHANGES
    assert await statistics.refresh_if_young(pool) == [], "analyzed again without growing"
