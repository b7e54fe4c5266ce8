"""Connections: the pool's codecs and timeouts, and the server-level probes (ping, clock,
version, the embedded server's database).

Claims and lease writes must never wait long on a lock (docs/architecture.md, the conversation
lease), so every pooled session gets bounded lock and statement timeouts.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias
from uuid import UUID

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from agentd.queries import Q
from agentd.vocabulary import EventType, MessageStatus, RunStatus

log = logging.getLogger("agentd.db")

# What the data layer's functions run on: the pool, a connection, or a pool's connection.
Db: TypeAlias = "asyncpg.Pool | asyncpg.Connection | PoolConnectionProxy"
# One session (a transaction's statements): a connection, or one borrowed from the pool.
Conn: TypeAlias = "asyncpg.Connection | PoolConnectionProxy"
EMBEDDED_DATABASE = "agentd"  # create_agentd_database names it (identifiers cannot be bound)


class _Borrowed:
    """A connection the caller already holds, as `acquire` hands one out."""

    def __init__(self, conn: Conn) -> None:
        self._conn = conn

    async def __aenter__(self) -> Conn:
        return self._conn

    async def __aexit__(self, *exc: object) -> None:
        return None


def acquire(db: Db) -> Any:
    """A connection for several statements in one session: borrowed from the pool, or the one
    the caller already holds (an async context manager either way)."""
    return db.acquire() if isinstance(db, asyncpg.Pool) else _Borrowed(db)


# What a database call can raise that says "not now" rather than "a bug": the connection broke
# or was refused, the server answered with an error, or the wait for it ran out.
DB_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError,
             asyncpg.InternalClientError, TimeoutError)
# Of those, the ones that say the database cannot be had right now (a request may be retried,
# a worker's write retried within its lease): the connection broke or was refused, the server is
# starting, stopping or restarting after a backend's crash (every session is ended then), or it
# has no connection left for a pool that grows.
UNAVAILABLE = (OSError, TimeoutError, asyncpg.InterfaceError,
               # What asyncpg raises when a pooled connection's backend was ended while it sat
               # idle (the server restarting, pg_terminate_backend) and the pool lends it once
               # more before it has noticed. asyncpg's own faults are of this class too: they
               # are logged with their traceback wherever this tuple is caught for a client.
               asyncpg.InternalClientError,
               # Class 08, its protocol violation (08P01) too: PgBouncer reports most of its
               # own refusals so (a query_wait_timeout, a server connection lost). It is also
               # what a statement sent wrong gets: logged with its traceback like the above.
               asyncpg.exceptions.PostgresConnectionError,
               asyncpg.exceptions.CannotConnectNowError, asyncpg.exceptions.AdminShutdownError,
               asyncpg.exceptions.CrashShutdownError, asyncpg.exceptions.TooManyConnectionsError)
# Of those, the ones raised before a statement could be sent: nothing is in doubt.
NOT_SENT = (asyncpg.exceptions.CannotConnectNowError, asyncpg.exceptions.TooManyConnectionsError,
            asyncpg.exceptions.ClientCannotConnectError,
            asyncpg.exceptions.ConnectionRejectionError)

@dataclass(frozen=True, slots=True)
class DbTimeouts:
    lock_timeout_ms: int = 5_000
    statement_timeout_ms: int = 30_000
    idle_in_transaction_ms: int = 60_000


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", schema="pg_catalog", encoder=json.dumps,
                              decoder=json.loads, format="text")
    await conn.set_type_codec("json", schema="pg_catalog", encoder=json.dumps,
                              decoder=json.loads, format="text")


async def _init_warm_connection(conn: asyncpg.Connection) -> None:
    await _init_connection(conn)
    await warm_up(conn)


# Ids that match no row: the warm-up's statements find nothing to write.
_NO_ROW = UUID(int=0)


def warm_up_statements() -> list[tuple[str, tuple[Any, ...]]]:
    """A turn's statements from its post to its end and its tails' and feed's reads, by name,
    each bound to arguments that match no row: no account, conversation or run has the nil id."""
    return [
        (Q.post_turn.name, Q.post_turn.bind(
            account_id=_NO_ROW, conversation_id=_NO_ROW, device_id=None, content="",
            request="{}", request_hash="", idempotency_key=None, default_max_queued=1,
            worker_id="warm-up", lease_ttl_s=1.0, default_max_running=1, model_guessed=False,
            guessed_model=None, claim_key=_NO_ROW)),
        (Q.append_events_fenced_many.name, Q.append_events_fenced_many.bind(
            run_ids=[_NO_ROW], claim_tokens=[_NO_ROW], seqs=[1],
            types=[str(EventType.CONTENT_DELTA)], payloads=["{}"])),
        (Q.finish_runs.name, Q.finish_runs.bind(
            run_ids=[_NO_ROW], claim_tokens=[_NO_ROW], statuses=[str(RunStatus.COMPLETED)],
            errors=[None], error_codes=[None], usages=[None], contents=[""],
            message_statuses=[str(MessageStatus.COMPLETE)], seqs=[1], event_run_ids=[],
            event_seqs=[], event_types=[], event_payloads=[])),
        (Q.read_events_after_many.name, Q.read_events_after_many.bind(
            run_ids=[_NO_ROW], after_seqs=[0], limit=1)),
        (Q.conversation_meta.name, Q.conversation_meta.bind(
            conversation_id=_NO_ROW, account_id=_NO_ROW)),
    ]


async def warm_up(conn: asyncpg.Connection) -> None:
    """Run a turn's statements once on a new session, in one transaction that is rolled back,
    with ids that match no row: its first turns then do not pay for preparing them, compiling
    the PL/pgSQL functions they call and planning the statements those calls reach, which a
    session does once (a post on a new session took ~12 ms against ~2.5 ms after:
    docs/benchmarks.md). Nothing is written (tests/integration/test_warm_up.py). A statement
    that fails is logged and ends the warm-up: the session still works, and its first turns
    pay what the warm-up would have."""
    transaction = conn.transaction()
    await transaction.start()
    try:
        for name, (sql, *args) in warm_up_statements():
            try:
                await conn.fetch(sql, *args)
            except asyncpg.PostgresError as exc:
                log.warning("could not warm a new database session",
                            extra={"statement": name, "sqlstate": exc.sqlstate,
                                   "error": str(exc)})
                break
    finally:
        await transaction.rollback()


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """Release without a reset round trip (asyncpg's default sends UNLISTEN/RESET ALL/...).

    Nothing agentd runs on a pooled connection leaves session state behind: no SET, LISTEN,
    advisory lock or cursor outside a transaction (the hub and the migrator have their own
    connections). asyncpg still rolls back an open transaction and drops listeners on release.
    """


def server_settings(timeouts: DbTimeouts, application_name: str = "agentd") -> dict[str, str]:
    return {
        "application_name": application_name,
        "lock_timeout": str(timeouts.lock_timeout_ms),
        "statement_timeout": str(timeouts.statement_timeout_ms),
        "idle_in_transaction_session_timeout": str(timeouts.idle_in_transaction_ms),
    }


async def create_pool(dsn: str, *, min_size: int = 2, max_size: int = 20,
                      timeouts: DbTimeouts | None = None,
                      application_name: str = "agentd",
                      statement_cache_size: int = 100,
                      pooled: bool = False, warm: bool = False) -> asyncpg.Pool:
    """A pool whose sessions decode json/jsonb and carry bounded lock/statement timeouts.

    `warm`: each new session runs a turn's statements once before its first use (warm_up),
    in whatever acquire opened it (at the start, or a request while the pool grows); never
    behind a transaction pooler, where the next statement may run on another server session.

    `pooled`: `dsn` is a transaction pooler (PgBouncer pool_mode = transaction). Consecutive
    statements may run on different server sessions, so nothing may live in one: no named
    prepared statements (PgBouncer before 1.21 cannot route them) and no session settings at
    startup (the pooler refuses unknown startup parameters): set the timeouts on the database
    or role instead (docs/operations.md, "Behind PgBouncer").
    """
    settings = server_settings(timeouts or DbTimeouts(), application_name)
    if pooled:
        settings = {"application_name": application_name}
        statement_cache_size = 0
    return await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size,
        init=_init_warm_connection if warm and not pooled else _init_connection,
        reset=_keep_session, server_settings=settings,
        statement_cache_size=statement_cache_size)


async def connect(dsn: str, *, application_name: str = "agentd",
                  timeouts: DbTimeouts | None = None, **kwargs: Any) -> asyncpg.Connection:
    """A single connection with the same codecs as the pool (the hub's, migrations', tests',
    the heartbeat's, which also bounds its waits with `timeouts`)."""
    settings = server_settings(timeouts, application_name) if timeouts is not None else \
        {"application_name": application_name}
    conn: asyncpg.Connection = await asyncpg.connect(dsn, server_settings=settings, **kwargs)
    await _init_connection(conn)
    return conn


async def fetch_one(db: Db, query: str, *args: Any) -> asyncpg.Record:
    """The row of a statement that always returns one (an upsert, an aggregate, a LEFT JOIN
    from a one-row VALUES): no row is a bug, raised as one rather than a TypeError later."""
    row = await db.fetchrow(query, *args)
    if row is None:
        raise RuntimeError(f"a statement that returns one row returned none: {query[:80]!r}")
    return row


async def ping(db: Db) -> None:
    """One round trip; raises when the server does not answer."""
    await db.fetchval(Q.ping.sql)


async def database_time(db: Db) -> datetime:
    """The database clock: the one time agentd trusts (the daemon's clock is not: see
    docs/architecture.md)."""
    now: datetime = await db.fetchval(Q.database_clock.sql)
    return now


async def clock_offset(db: Db, samples: int = 5) -> float:
    """Seconds to add to this machine's clock to read the database's (measured around the
    quickest of a few round trips). Only for figures such as stream lag: leases never use it."""
    best: tuple[float, float] | None = None
    for _ in range(samples):
        before = time.time()
        now = await database_time(db)
        after = time.time()
        if best is None or after - before < best[0]:
            best = (after - before, now.timestamp() - (before + after) / 2)
    assert best is not None
    return best[1]


async def server_version(db: Db) -> str:
    version: str = await db.fetchval(Q.server_version.sql)
    return version


async def connection_budget(db: Db) -> int:
    """How many connections the server lets agentd's role open (see the statement)."""
    budget: int = await db.fetchval(*Q.connection_budget.bind())
    return budget


async def ensure_agentd_database(admin: asyncpg.Connection) -> None:
    """On the embedded server: create the `agentd` database once, on first start.

    Processes starting together on a new cluster can all find it missing; all but one then
    fail to create it (a duplicate name, or the catalog's unique index when the creations
    overlap), which is what they wanted."""
    if await admin.fetchval(*Q.database_exists.bind(name=EMBEDDED_DATABASE)):
        return
    try:
        await admin.execute(Q.create_agentd_database.sql)
    except (asyncpg.exceptions.DuplicateDatabaseError, asyncpg.exceptions.UniqueViolationError):
        if not await admin.fetchval(*Q.database_exists.bind(name=EMBEDDED_DATABASE)):
            raise


async def set_own_password(conn: asyncpg.Connection, password: str) -> None:
    """Give the connected role a new password without building SQL from it.

    ALTER ROLE takes no bound parameters: the password travels as a transaction-local setting
    and the server quotes it itself (format %L).
    """
    async with conn.transaction():
        await conn.execute(*Q.stage_own_password.bind(password=password))
        await conn.execute(Q.set_own_password.sql)
