"""A worker's start that fails part-way closes what it had started: no task keeps running and
no connection stays open behind the error (a supervisor's worker, or a test, lives on after it).
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest
from aiohttp import web

from agentd import runtime
from agentd.listen import bind_listen_sockets
from agentd.settings import Settings
from agentd.startup import Database
from tests.support.daemon import poll_until


class StartBroke(OSError):
    """The fault the test injects (a database gone mid-start looks like this)."""


async def _broken(*args: Any, **kwargs: Any) -> None:
    raise StartBroke("the database went away")


async def _sessions(pool: asyncpg.Pool) -> list[str]:
    """Sessions the daemon's own parts opened (the pool's are closed by serve's caller)."""
    return [r["application_name"] for r in await pool.fetch(
        "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name IN ('agentd-hub', 'agentd-heartbeat')")]


@pytest.mark.parametrize("breaks", ["clock_offset", "app_setup"])
async def test_a_start_that_fails_part_way_leaves_no_task_or_connection(
        dsn: str, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch, breaks: str) -> None:
    if breaks == "clock_offset":  # just after the hub connected
        monkeypatch.setattr(runtime.dbmod, "clock_offset", _broken)
    else:  # with the hub, the heartbeat, the notifier and the watchers running
        monkeypatch.setattr(web.AppRunner, "setup", _broken)
    settings = Settings(dsn=dsn, listen="127.0.0.1:0")
    sockets = bind_listen_sockets("127.0.0.1", 0)
    before = asyncio.all_tasks()
    serving = runtime._serve_with_pool(settings, Database(dsn), pool, asyncio.Event(),
                                       asyncio.Event(), sockets, None)
    try:
        with pytest.raises(StartBroke):
            await asyncio.wait_for(serving, 30)
    finally:
        for sock in sockets:
            sock.close()
    left = asyncio.all_tasks() - before
    assert not left, f"tasks left running: {sorted(t.get_name() for t in left)}"
    # Closing a connection is told to the server asynchronously: poll for it.
    await poll_until(lambda: _closed(pool), 10, what="the parts' sessions to close")


async def _closed(pool: asyncpg.Pool) -> bool:
    return not await _sessions(pool)
