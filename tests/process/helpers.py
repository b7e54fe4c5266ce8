"""What process tests need besides daemons: wait for the states a run reaches in the database.

Everything is observed through the test's own connections; a daemon's memory is never trusted.
Turns are made with tests/support/factories.py and their rows read with tests/support/journal.py.
"""

from __future__ import annotations

from uuid import UUID

import asyncpg

from agentd.vocabulary import RunStatus
from tests.support.daemon import poll_until
from tests.support.journal import wait_status

Db = asyncpg.Pool | asyncpg.Connection
TERMINAL = tuple(str(s) for s in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED))
STARTED = (str(RunStatus.RUNNING), *TERMINAL)
# A drain far longer than any wait of the tests that use it: an exit within it was cut short.
LONG_DRAIN_S = 120.0
__all__ = ["STARTED", "TERMINAL", "wait_status"]  # wait_status lives in tests/support/journal.py


async def wait_streaming(db: Db, run_id: UUID, *, timeout: float,  # noqa: ASYNC109
                         min_deltas: int = 1) -> asyncpg.Record:
    """Poll until the run is running and has journaled answer text; returns the row."""

    async def streaming() -> asyncpg.Record | None:
        row = await db.fetchrow(
            "SELECT r.*, (SELECT count(*) FROM run_event e WHERE e.run_id = r.id"
            "             AND e.type = 'content_delta') AS deltas"
            " FROM agent_run r WHERE r.id = $1", run_id)
        ok = row is not None and row["status"] == RunStatus.RUNNING and \
            row["deltas"] >= min_deltas
        return row if ok else None

    return await poll_until(streaming, timeout, what=f"run {run_id} to stream")


async def database_now(db: Db) -> object:
    return await db.fetchval("SELECT clock_timestamp()")
