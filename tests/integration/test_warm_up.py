"""A new pooled session runs a turn's statements once before its first use (db.warm_up), so
the first turns a daemon serves do not pay for preparing them and compiling the PL/pgSQL
functions they call; and the warm-up writes nothing and locks no row, not even for a moment (an
undone update of a row others lock is what PostgreSQL 18 failed rivals over:
tests/integration/test_no_write_undone.py).
"""

from __future__ import annotations

import logging

import asyncpg
import pytest

from agentd import db as dbmod
from agentd.db import warm_up, warm_up_statements
from agentd.queue import claim_runs
from tests.support.factories import enqueue, new_tenant

# What this transaction has written to any table so far, undone writes included.
WRITTEN = """
SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint
FROM pg_stat_xact_user_tables
"""
# Any write or row lock gives the transaction an id; an advisory lock shows in pg_locks.
TOUCHED = """
SELECT pg_current_xact_id_if_assigned() IS NOT NULL
       OR EXISTS (SELECT 1 FROM pg_locks
                  WHERE pid = pg_backend_pid() AND locktype = 'advisory')
"""


@pytest.mark.parametrize("line", ["empty", "queued", "running"])
async def test_the_warm_up_writes_and_locks_nothing_whatever_the_queue_holds(
        pool: asyncpg.Pool, line: str) -> None:
    tenant = await new_tenant(pool)
    if line != "empty":
        await enqueue(pool, tenant.account_id, tenant.conversation_id, "waiting")
    if line == "running":
        assert await claim_runs(pool, worker_id="w", lease_ttl_s=60)
    async with pool.acquire() as conn:
        for name, (sql, *args) in warm_up_statements():
            async with conn.transaction():
                before = await conn.fetchval(WRITTEN)
                await conn.fetch(sql, *args)  # the made-up ids are answered, not refused
                assert await conn.fetchval(WRITTEN) == before, name
                assert not await conn.fetchval(TOUCHED), name
        # The probes can see what they look for: an undone insert counts, and takes an id.
        async with conn.transaction():
            before = await conn.fetchval(WRITTEN)
            undone = conn.transaction()
            await undone.start()
            await enqueue(conn, tenant.account_id, tenant.conversation_id, "undone")
            await undone.rollback()
            assert await conn.fetchval(WRITTEN) > before
            assert await conn.fetchval(TOUCHED)


async def test_a_new_session_warms_in_one_rolled_back_transaction_without_a_word(
        pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture) -> None:
    async with pool.acquire() as conn:
        with caplog.at_level(logging.WARNING, logger="agentd.db"):
            await warm_up(conn)
        assert not caplog.records, "every statement ran"
        assert not conn.is_in_transaction()


async def test_a_statement_that_fails_is_logged_and_the_session_still_works(
        pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = warm_up_statements()
    monkeypatch.setattr(dbmod, "warm_up_statements",
                        lambda: [real[0], ("gone", ("SELECT no_such_function()",)), *real[1:]])
    async with pool.acquire() as conn:
        with caplog.at_level(logging.WARNING, logger="agentd.db"):
            await warm_up(conn)
        assert [(r.message, getattr(r, "statement", None)) for r in caplog.records] == [
            ("could not warm a new database session", "gone")]
        assert not conn.is_in_transaction()
        assert await conn.fetchval("SELECT 1") == 1


async def test_each_new_pooled_session_has_the_turns_statements_ready(dsn: str) -> None:
    wanted = {sql for _, (sql, *_args) in warm_up_statements()}
    pool = await dbmod.create_pool(dsn, min_size=1, max_size=2, warm=True)
    try:
        async with pool.acquire() as first, pool.acquire() as second:  # the second opens now
            for conn in (first, second):
                prepared = {row["statement"] for row in
                            await conn.fetch("SELECT statement FROM pg_prepared_statements")}
                assert wanted <= prepared
    finally:
        await pool.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["direct", "transaction-pooler"])
async def test_the_warm_up_runs_once_per_session_and_never_behind_a_transaction_pooler(
        dsn: str, pooled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a pooler the next statement may run on another server session: warming the
    one that happens to serve the warm-up is useless."""
    warmed: list[int] = []

    async def record(conn: asyncpg.Connection) -> None:
        warmed.append(conn.get_server_pid())

    monkeypatch.setattr(dbmod, "warm_up", record)
    pool = await dbmod.create_pool(dsn, min_size=1, max_size=2, pooled=pooled, warm=True)
    try:
        async with pool.acquire() as first, pool.acquire() as second:
            sessions = [first.get_server_pid(), second.get_server_pid()]
        async with pool.acquire():
            pass
    finally:
        await pool.close()
    assert warmed == ([] if pooled else sessions)
