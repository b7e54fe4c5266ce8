"""Admission by capacity against a real pool: a pool wait still under way counts."""

from __future__ import annotations

from agentd import db as dbmod
from agentd.load import LoadMonitor
from agentd.metrics import Metrics
from tests.support.daemon import poll_until


async def test_a_pool_wait_still_under_way_holds_admission_back(dsn: str) -> None:
    """The probe records a wait only once it gets its connection, up to 10 s later. Admission
    looked at the last second's finished samples alone: while the pool stayed exhausted it saw
    none after the first second, and let claims in again into a pool with nothing to give."""
    pool = await dbmod.create_pool(dsn, min_size=1, max_size=1)
    load = LoadMonitor(pool, Metrics(), max_loop_lag_s=60.0, max_pool_wait_s=0.1)
    try:
        async with pool.acquire():  # the pool's only connection, held: every probe waits
            load.start()
            reason = await poll_until(load.overload, 3, what="admission to hold back")
            assert "pool wait" in reason and "max_pool_wait_ms" in reason
        await poll_until(lambda: load.overload() is None, 5, what="admission to recover")
    finally:
        await load.close()
        await pool.close()
