"""The migrations build the schema the code expects, once, even when a fleet starts at once.

The CHECK lists, NOTIFY channels and invariant-carrying indexes are compared against
agentd.vocabulary and the named statements, so neither side can drift alone.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from agentd.migrate import MIGRATION_LOCK_KEY, MigrationError, discover, migrate
from agentd.queries import Q, sql_dir
from agentd.vocabulary import Channel, EventType, MessageRole, MessageStatus, RunStatus
from tests.support.daemon import poll_until
from tests.support.db import with_database
from tests.support.factories import enqueue, new_tenant

SCHEMA_FINGERPRINT = """
SELECT coalesce(array_agg(item ORDER BY item), '{}') FROM (
    SELECT 'table ' || c.relname || ' ' || c.relkind::text AS item
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = 'public'
    UNION ALL
    SELECT 'constraint ' || conrelid::regclass || ' ' || conname || ' '
           || pg_get_constraintdef(oid)
    FROM pg_constraint WHERE connamespace = 'public'::regnamespace
    UNION ALL
    SELECT 'index ' || indexname || ' ' || indexdef FROM pg_indexes WHERE schemaname = 'public'
) AS items
"""


@pytest.fixture
async def empty_dsn(pg_admin_dsn: str) -> AsyncIterator[str]:
    """A database nothing has touched: no template, no migrations."""
    name = f"agentd_empty_{uuid.uuid4().hex[:16]}"
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield with_database(pg_admin_dsn, name)
    finally:
        admin = await asyncpg.connect(pg_admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def test_migrations_apply_to_an_empty_database_and_rerun_is_a_no_op(empty_dsn: str) -> None:
    expected = [m.name for m in discover()]
    assert expected and expected[0] == "001_core"
    conn = await asyncpg.connect(empty_dsn)
    try:
        assert await migrate(conn) == expected
        first = await conn.fetchval(SCHEMA_FINGERPRINT)
        ledger = await conn.fetch("SELECT version, name, checksum FROM schema_migrations"
                                  " ORDER BY version")
        assert [(r["version"], r["name"], r["checksum"]) for r in ledger] == [
            (m.version, m.name, m.checksum) for m in discover()]

        assert await migrate(conn) == []
        assert await conn.fetchval(SCHEMA_FINGERPRINT) == first
        assert await conn.fetchval("SELECT count(*) FROM schema_migrations") == len(expected)
        # The migrator's session is still open, yet another migrator is not kept waiting.
        other = await asyncpg.connect(empty_dsn)
        try:
            assert await other.fetchval("SELECT pg_try_advisory_lock($1::bigint)",
                                        MIGRATION_LOCK_KEY)
        finally:
            await other.close()
    finally:
        await conn.close()
    for table in ("account", "device", "conversation", "agent_run", "message", "run_event",
                  "conversation_lease"):
        assert f"table {table} r" in first


MIGRATOR = """
import asyncio, json, sys
import asyncpg
from agentd.migrate import migrate

async def main(dsn):
    conn = await asyncpg.connect(dsn)
    try:
        print("ready", flush=True)
        sys.stdin.readline()
        print(json.dumps(await migrate(conn)), flush=True)
    finally:
        await conn.close()

asyncio.run(main(sys.argv[1]))
"""


async def test_two_processes_migrating_at_once_apply_the_schema_once(empty_dsn: str) -> None:
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", MIGRATOR, empty_dsn, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE) for _ in range(2)]
    try:
        # Both are connected and waiting before either starts: the migrations truly overlap.
        for proc in procs:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line.strip() == b"ready", (line, await proc.stderr.read())
        for proc in procs:
            proc.stdin.write(b"go\n")
        await asyncio.gather(*(proc.stdin.drain() for proc in procs))
        outputs = await asyncio.wait_for(
            asyncio.gather(*(proc.communicate() for proc in procs)), 60)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    for proc, (_out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err.decode()
    applied = sorted((json.loads(out) for out, _ in outputs), key=len)
    assert applied == [[], [m.name for m in discover()]]

    conn = await asyncpg.connect(empty_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM schema_migrations") == len(discover())
        assert await conn.fetchval("SELECT to_regclass('agent_run') IS NOT NULL")
    finally:
        await conn.close()


async def test_a_migration_outlasts_the_timeouts_a_database_sets_for_its_sessions(
        empty_dsn: str, tmp_path: Path) -> None:
    """A pooled fleet sets lock and statement timeouts on its database (docs/operations.md):
    a migrator that waits for another's lock, then runs a long migration, must not be cut
    short by them (before, it failed with a lock timeout, and a long migration never could
    finish)."""
    admin = await asyncpg.connect(empty_dsn)
    try:
        database = await admin.fetchval("SELECT current_database()")
        await admin.execute(f'ALTER DATABASE "{database}" SET lock_timeout = \'100ms\'')
        await admin.execute(f'ALTER DATABASE "{database}" SET statement_timeout = \'100ms\'')
        if admin.get_server_version().major >= 17:  # the setting is new in PostgreSQL 17
            await admin.execute(
                f'ALTER DATABASE "{database}" SET transaction_timeout = \'100ms\'')
        (tmp_path / "001_long.sql").write_text("SELECT pg_sleep(0.3); CREATE TABLE long (x int);")
        holder = await asyncpg.connect(empty_dsn)
        migrator = await asyncpg.connect(empty_dsn)
        try:
            await holder.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
            migrating = asyncio.create_task(migrate(migrator, tmp_path))
            pid = migrator.get_server_pid()

            async def waited_past_the_timeout() -> bool:  # waiting for the lock, 3× its timeout
                if migrating.done():
                    migrating.result()  # it gave up waiting: its error fails the test here
                return bool(await admin.fetchval(
                    "SELECT wait_event_type = 'Lock' AND now() - state_change > '300ms'"
                    " FROM pg_stat_activity WHERE pid = $1", pid))

            await poll_until(waited_past_the_timeout, 10, what="the migrator to wait long")
            assert not migrating.done()
            await holder.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
            assert await asyncio.wait_for(migrating, 30) == ["001_long"]
        finally:
            await holder.close()
            await migrator.close()
        assert await admin.fetchval("SELECT to_regclass('long') IS NOT NULL")
    finally:
        await admin.close()


async def test_an_edited_migration_is_refused(dsn: str, tmp_path: Path) -> None:
    for migration in sql_dir().glob("0*.sql"):
        shutil.copy(migration, tmp_path / migration.name)
    core = tmp_path / "001_core.sql"
    core.write_text(core.read_text("utf-8") + "\n-- edited after release\n", "utf-8")
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(MigrationError, match="changed after it was applied"):
            await migrate(conn, tmp_path)
        assert await conn.fetchval("SELECT count(*) FROM schema_migrations") == len(discover())
    finally:
        await conn.close()


async def test_a_skipped_number_is_fine_but_a_duplicate_or_late_older_migration_is_refused(
        dsn: str, tmp_path: Path) -> None:
    for migration in sql_dir().glob("0*.sql"):
        shutil.copy(migration, tmp_path / migration.name)
    newest = max(m.version for m in discover())
    conn = await asyncpg.connect(dsn)
    try:
        # A number left free (reserved for a change still in review) is no error.
        (tmp_path / f"{newest + 2:03d}_later.sql").write_text("CREATE TABLE later (x int);")
        assert await migrate(conn, tmp_path) == [f"{newest + 2:03d}_later"]
        # The reserved number arriving after a newer one was applied would run out of order.
        (tmp_path / f"{newest + 1:03d}_late.sql").write_text("CREATE TABLE late (x int);")
        with pytest.raises(MigrationError, match=f"older than version {newest + 2}"):
            await migrate(conn, tmp_path)
        assert await conn.fetchval("SELECT to_regclass('late')") is None
        (tmp_path / f"{newest + 2:03d}_twin.sql").write_text("SELECT 1;")
        with pytest.raises(MigrationError, match="share version"):
            discover(tmp_path)
    finally:
        await conn.close()


async def test_every_named_statement_prepares_against_the_migrated_schema(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        failures = {}
        for statement in Q:
            try:
                await conn.prepare(statement.sql)
            except asyncpg.PostgresError as exc:
                failures[statement.name] = str(exc)
        assert failures == {}
    finally:
        await conn.close()


async def test_every_function_of_the_schema_keeps_its_plans(dsn: str) -> None:
    """PostgreSQL plans a SQL-language function's query afresh at every call unless it can
    inline it, which it could not for any of agentd's (sql/020: 0.3-0.4 ms a turn each): the
    schema's functions are PL/pgSQL, whose plans are cached per session."""
    conn = await asyncpg.connect(dsn)
    try:
        languages = await conn.fetch(
            """
            SELECT p.proname, l.lanname
            FROM pg_proc p
            JOIN pg_namespace n ON n.oid = p.pronamespace
            JOIN pg_language l ON l.oid = p.prolang
            WHERE n.nspname = current_schema()
            """)
        assert {r["proname"] for r in languages} >= {
            "turn_transcript", "answer_open_tool_calls", "journal_text", "post_turn"}
        assert {r["proname"]: r["lanname"] for r in languages
                if r["lanname"] != "plpgsql"} == {}
    finally:
        await conn.close()


async def _check_values(conn: asyncpg.Connection, table: str, column: str) -> set[str]:
    """The literals of the one single-column CHECK constraint on table.column."""
    defs = await conn.fetch(
        """
        SELECT pg_get_constraintdef(c.oid) AS def
        FROM pg_constraint c
        JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
        WHERE c.conrelid = $1::regclass AND c.contype = 'c'
          AND cardinality(c.conkey) = 1 AND a.attname = $2
        """, table, column)
    assert len(defs) == 1, f"expected one CHECK on {table}.{column}, found {len(defs)}"
    return set(re.findall(r"'((?:[^']|'')*)'::text", defs[0]["def"]))


@pytest.mark.parametrize(("table", "column", "vocabulary"), [
    ("agent_run", "status", RunStatus),
    ("message", "status", MessageStatus),
    ("message", "role", MessageRole),
    ("run_event", "type", EventType),
])
async def test_check_constraints_list_exactly_the_vocabulary(
        dsn: str, table: str, column: str, vocabulary: type) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        assert await _check_values(conn, table, column) == {str(v) for v in vocabulary}
    finally:
        await conn.close()


def test_every_notify_channel_in_the_queries_is_a_vocabulary_channel() -> None:
    text = (sql_dir() / "queries.sql").read_text("utf-8")
    literals = set(re.findall(r"pg_notify\(\s*'([^']*)'", text))
    assert len(literals) >= 4, literals  # the scan itself found the statements' channels
    assert literals <= {str(c) for c in Channel}, literals - {str(c) for c in Channel}
    # No channel is ever named by a non-literal expression the scan above would miss, except
    # in notify_batch, whose channels are typed as vocabulary.Channel by its only callers.
    batch = Q.notify_batch.sql
    rest = text.replace(batch, "")
    assert batch in text and "pg_notify(t.channel" in batch
    # The channel notify_batch singles out (the dispatchers' wake, sent only with work queued).
    assert set(re.findall(r"channel = '([^']*)'", batch)) == {str(Channel.RUN_ENQUEUED)}
    assert len(re.findall(r"pg_notify\(", rest)) == len(re.findall(r"pg_notify\(\s*'", rest))


INDEX_SHAPE = """
SELECT t.relname AS table_name, i.indisunique AS is_unique,
       pg_get_expr(i.indpred, i.indrelid) AS predicate,
       array(SELECT a.attname FROM unnest(i.indkey) WITH ORDINALITY AS k (attnum, pos)
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
             ORDER BY k.pos)::text[] AS columns
FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
JOIN pg_class t ON t.oid = i.indrelid
WHERE c.relname = $1
"""


@pytest.mark.parametrize(("index", "table", "columns", "predicate"), [
    ("one_running_per_conversation", "agent_run", ["conversation_id"],
     "(status = 'running'::text)"),
    ("one_complete_per_run", "run_event", ["run_id"], "(type = 'complete'::text)"),
    ("agent_run_idempotency_key", "agent_run", ["account_id", "idempotency_key"],
     "(idempotency_key IS NOT NULL)"),
])
async def test_invariant_indexes_are_unique_and_partial(
        dsn: str, index: str, table: str, columns: list[str], predicate: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        shape = await conn.fetchrow(INDEX_SHAPE, index)
    finally:
        await conn.close()
    assert shape is not None, f"index {index} is missing"
    assert shape["table_name"] == table
    assert shape["is_unique"]
    assert shape["columns"] == columns
    assert shape["predicate"] == predicate


async def test_schema_alone_refuses_a_second_running_turn_and_a_second_ending(
        pool: asyncpg.Pool) -> None:
    """Bypass every application check: the indexes still hold the invariants."""
    tenant = await new_tenant(pool)
    first = await enqueue(pool, tenant.account_id, tenant.conversation_id, "one")
    second = await enqueue(pool, tenant.account_id, tenant.conversation_id, "two")
    start = """
        UPDATE agent_run SET status = 'running', claim_token = gen_random_uuid(),
               fence = nextval('agent_run_fence_seq'), worker_id = 'raw',
               lease_expires_at = clock_timestamp() + interval '1 minute'
        WHERE id = $1
    """
    await pool.execute(start, first.run_id)
    with pytest.raises(asyncpg.UniqueViolationError, match="one_running_per_conversation"):
        await pool.execute(start, second.run_id)
    # Partial: once the first turn is terminal, the next may run.
    await pool.execute("UPDATE agent_run SET status = 'completed', finished_at = now()"
                       " WHERE id = $1", first.run_id)
    await pool.execute(start, second.run_id)

    ending = ("INSERT INTO run_event (run_id, seq, type, payload)"
              " VALUES ($1, $2, 'complete', '{}')")
    await pool.execute(ending, first.run_id, 3)
    with pytest.raises(asyncpg.UniqueViolationError, match="one_complete_per_run"):
        await pool.execute(ending, first.run_id, 4)
    # Same position twice is refused by the key, whatever the type.
    with pytest.raises(asyncpg.UniqueViolationError, match="run_event_pkey"):
        await pool.execute("INSERT INTO run_event (run_id, seq, type, payload)"
                           " VALUES ($1, 3, 'content_delta', '{}')", first.run_id)
