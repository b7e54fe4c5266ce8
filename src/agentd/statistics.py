"""Planner statistics of the queue's hot tables, kept fresh while the tables are young.

The hot statements keep one generic plan per connection (sql/011: planning them on every call
cost more than running them), and a generic plan is only as good as the statistics it was made
with. A new database has none: every partial index of agent_run then looks as small as the
next, and a plan made in the first seconds can read a whole index on every call (seen: the
terminal write scanning every running run's slot to find one). Autovacuum analyzes a table only
after a minute's nap and 10% of it changed; until a table is large, agentd asks for an ANALYZE
itself each time the table has changed by as many rows as it held when last analyzed (so a
handful of times while it grows), which also makes every cached plan that reads it be made
again, with the new figures.
"""

from __future__ import annotations

import asyncio
import logging

from agentd.db import DB_ERRORS, Db, acquire
from agentd.queries import Q

log = logging.getLogger("agentd.statistics")

HOT_TABLES = ("agent_run", "run_event", "message", "conversation", "conversation_lease")
MIN_CHANGES = 500  # a table is first analyzed once it has seen this many changes
GROWN_UP_ROWS = 1_000_000  # from here on autovacuum's own thresholds keep up
CHECK_EVERY_S = 2.0


async def refresh_if_young(db: Db) -> list[str]:
    """ANALYZE each hot table that has outgrown its statistics; returns their names (empty
    when nothing was due, or another process is at it)."""
    due = [row["name"] for row in await db.fetch(*Q.young_tables_due.bind(
        tables=list(HOT_TABLES), min_changes=MIN_CHANGES, grown_up_rows=GROWN_UP_ROWS))]
    if not due:
        return []
    async with acquire(db) as conn, conn.transaction():
        if not await conn.fetchval(Q.try_statistics_lock.sql):
            return []  # another process of the fleet is analyzing them now
        # Only the tables that are due: one that stays small but changes all the time (every
        # enqueue touches its conversation) would otherwise take the large ones along each time.
        await conn.execute(*Q.analyze_tables.bind(tables=due))
    return due


async def keep_fresh_forever(db: Db, *, every_s: float = CHECK_EVERY_S) -> None:
    """Check every `every_s` seconds; failures are logged and retried (plans merely stay)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            analyzed = await refresh_if_young(db)
        except DB_ERRORS as exc:
            log.warning("could not refresh planner statistics", extra={"error": str(exc)})
            continue
        if analyzed:
            log.info("refreshed planner statistics", extra={"tables": analyzed})
