"""Shared tools for the integration tests: real connections, real races, polled states.

Races release independent connections together through an asyncio.Barrier; states are polled
against a deadline (never slept for), and lease expiry is judged by the database clock. Accounts,
turns and the journal checks come from tests/support (factories, journal).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from uuid import UUID

import asyncpg

from agentd import db as dbmod
from agentd.queue import Claim, claim_runs
from tests.support.daemon import poll_until

Executor = asyncpg.Pool | asyncpg.Connection

DEFAULT_TIMEOUT_S = 10.0


async def wait_lease_expired(db: Executor, run_id: UUID, *,
                             within: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until the database clock has passed the run's lease deadline."""

    async def expired() -> bool:
        return bool(await db.fetchval(
            "SELECT lease_expires_at <= clock_timestamp() FROM agent_run WHERE id = $1", run_id))

    await poll_until(expired, within, interval=0.002, what=f"lease of run {run_id} to expire")


async def race(*actions: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Start every action at the same instant; results (or raised exceptions) in order."""
    barrier = asyncio.Barrier(len(actions))

    async def run(action: Callable[[], Awaitable[Any]]) -> Any:
        await barrier.wait()
        return await action()

    return await asyncio.gather(*(run(a) for a in actions), return_exceptions=True)


async def claim_after_round_trips(conn: asyncpg.Connection, trips: int,
                                  **claim: Any) -> list[Claim]:
    """claim_runs, set off `trips` round trips late: a race against a rival of several round
    trips then lands the claim before, inside and after the rival's transaction, instead of
    the same way every time on a given machine."""
    for _ in range(trips):
        await conn.fetchval("SELECT 1")
    return await claim_runs(conn, **claim)


def raise_unexpected(results: list[Any], *allowed: type[BaseException], context: str = "") -> None:
    """Re-raise the first exception among race results that is not of an allowed type."""
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, allowed):
            if context:
                result.add_note(f"race: {context}")
            raise result


@contextlib.asynccontextmanager
async def connections(dsn: str, n: int) -> AsyncIterator[list[asyncpg.Connection]]:
    """`n` independent sessions (each its own backend), with the daemon's codecs."""
    conns = list(await asyncio.gather(*(dbmod.connect(dsn, application_name="agentd-test")
                                        for _ in range(n))))
    try:
        yield conns
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)


async def lease_row(db: Executor, conversation_id: UUID) -> asyncpg.Record | None:
    return await db.fetchrow(
        "SELECT * FROM conversation_lease WHERE conversation_id = $1", conversation_id)


async def count_rows(db: Executor, run_id: UUID) -> tuple[int, int]:
    """(journal rows, message rows) of one run: what a zombie must not change."""
    row = await db.fetchrow(
        "SELECT (SELECT count(*) FROM run_event WHERE run_id = $1) AS events,"
        "       (SELECT count(*) FROM message WHERE run_id = $1) AS messages", run_id)
    return row["events"], row["messages"]


class Listener:
    """A LISTEN session of its own: notifications land in a queue, read with a deadline."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.received: asyncio.Queue[str] = asyncio.Queue()

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self.received.put_nowait(payload)

    async def listen(self, channel: str) -> None:
        await self.conn.add_listener(channel, self._on_notify)

    async def next(self, within: float = DEFAULT_TIMEOUT_S) -> str:
        return await asyncio.wait_for(self.received.get(), within)

    def drain(self) -> list[str]:
        items = []
        while not self.received.empty():
            items.append(self.received.get_nowait())
        return items


@contextlib.asynccontextmanager
async def listening(dsn: str, channel: str) -> AsyncIterator[Listener]:
    conn = await asyncpg.connect(dsn)
    listener = Listener(conn)
    try:
        await listener.listen(channel)
        yield listener
    finally:
        await conn.close()

