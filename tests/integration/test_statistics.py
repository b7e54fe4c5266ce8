"""Planner statistics of the hot tables while they are young: asked for once a table has
outgrown the figures it was last analyzed with, and not again until it grows as much again;
only the tables that are due are analyzed."""

from __future__ import annotations

from uuid import UUID

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


async def analyze_counts(pool: asyncpg.Pool) -> dict[str, int]:
    rows = await pool.fetch("SELECT relname::text AS name, analyze_count FROM pg_stat_user_tables"
                            " WHERE schemaname = current_schema() AND relname = ANY ($1::text[])",
                            list(statistics.HOT_TABLES))
    return {row["name"]: row["analyze_count"] for row in rows}


async def fill(pool: asyncpg.Pool) -> UUID:
    """A tenant with 20 conversations and enough turns to make agent_run due; its account."""
    tenant = await new_tenant(pool)
    conversations = [await new_conversation(pool, tenant.account_id) for _ in range(20)]
    runs = [NewRun(conversations[n % 20], f"turn {n}", {"content": "x", "model": "demo"})
            for n in range(statistics.MIN_CHANGES + 10)]
    async with pool.acquire() as conn:
        for start in range(0, len(runs), 100):
            await enqueue_runs(conn, account_id=tenant.account_id, runs=runs[start:start + 100],
                               default_max_queued=10_000)
        await publish_counts(conn)
    return tenant.account_id


async def publish_counts(conn: asyncpg.Connection) -> None:
    """Publish this session's table counts now, all at once. Otherwise the server sends them
    when a transaction ends, at most once a second, and a table could come due later on the
    counts left over."""
    await conn.execute("SELECT pg_stat_force_next_flush()")


async def test_a_young_table_is_analyzed_once_it_outgrows_its_statistics(
        pool: asyncpg.Pool) -> None:
    assert await statistics.refresh_if_young(pool) == [], "nothing has changed yet"
    await fill(pool)
    analyzed = await poll_until(lambda: statistics.refresh_if_young(pool), DEFAULT_TIMEOUT_S,
                                interval=0.2, what="agent_run to be due for statistics")
    assert "agent_run" in analyzed and "run_event" in analyzed
    assert await last_analyzed(pool) is not None
    reltuples = await pool.fetchval("SELECT reltuples FROM pg_class WHERE relname = 'agent_run'"
                                    " AND relnamespace = current_schema()::regnamespace")
    assert reltuples >= statistics.MIN_CHANGES
    assert await statistics.refresh_if_young(pool) == [], "analyzed again without growing"


async def test_a_small_table_that_keeps_changing_is_analyzed_alone(pool: asyncpg.Pool) -> None:
    # Every enqueue moves its conversation's updated_at: a table of a few rows that changes all
    # the time is due again and again, and must not take the large tables along each time.
    account_id = await fill(pool)
    await poll_until(lambda: statistics.refresh_if_young(pool), DEFAULT_TIMEOUT_S,
                     interval=0.2, what="the filled tables to be due for statistics")

    async def first_counted() -> dict[str, int] | None:
        now = await analyze_counts(pool)
        return now if now.get("agent_run", 0) > 0 else None

    before = await poll_until(first_counted, DEFAULT_TIMEOUT_S, interval=0.2,
                              what="the first analysis to be counted")
    async with pool.acquire() as conn:
        for _ in range(statistics.MIN_CHANGES // 20 + 5):
            await conn.execute("UPDATE conversation SET updated_at = clock_timestamp()"
                               " WHERE account_id = $1", account_id)
        await publish_counts(conn)
    analyzed = await poll_until(lambda: statistics.refresh_if_young(pool), DEFAULT_TIMEOUT_S,
                                interval=0.2, what="conversation to be due for statistics")
    assert analyzed == ["conversation"]

    async def counted() -> dict[str, int] | None:
        now = await analyze_counts(pool)
        return now if now.get("conversation", 0) > before.get("conversation", 0) else None

    after = await poll_until(counted, DEFAULT_TIMEOUT_S, interval=0.2,
                             what="the conversation table's analysis to be counted")
    assert {name: count for name, count in after.items() if name != "conversation"} == \
        {name: count for name, count in before.items() if name != "conversation"}


async def test_payload_columns_get_no_statistics_and_keys_keep_theirs(pool: asyncpg.Pool) -> None:
    # sql/016: sorting a sample of JSON documents was most of an ANALYZE of the journal, for
    # statistics no statement uses; the columns that plans do use keep theirs.
    await fill(pool)
    await poll_until(lambda: statistics.refresh_if_young(pool), DEFAULT_TIMEOUT_S,
                     interval=0.2, what="the filled tables to be due for statistics")
    rows = await pool.fetch("SELECT tablename::text AS t, attname::text AS c FROM pg_stats"
                            " WHERE schemaname = current_schema()"
                            " AND tablename IN ('agent_run', 'run_event')")
    analyzed = {(row["t"], row["c"]) for row in rows}
    assert {("run_event", "run_id"), ("run_event", "type"), ("agent_run", "status"),
            ("agent_run", "conversation_id")} <= analyzed
    assert not analyzed & {("run_event", "payload"), ("agent_run", "request"),
                           ("agent_run", "usage")}
