"""Reading a run's rows through the test's own connections, and the journal's promises.

`assert_journal_sound` is the suite's one check of the journal invariant: seqs are exactly 1..n
and there is at most one `complete`, which is the last event.
"""

from __future__ import annotations

from uuid import UUID

import asyncpg

from agentd.vocabulary import EventType
from tests.support.daemon import poll_until

Db = asyncpg.Pool | asyncpg.Connection


def as_uuid(run_id: UUID | str) -> UUID:
    return run_id if isinstance(run_id, UUID) else UUID(run_id)


async def read_journal(db: Db, run_id: UUID | str) -> list[asyncpg.Record]:
    """The run's journal in seq order: seq, type, payload, created_at and `xid` (the writing
    transaction, to tell events committed together)."""
    return await db.fetch(
        "SELECT seq, type, payload, created_at, xmin::text AS xid FROM run_event"
        " WHERE run_id = $1 ORDER BY seq", as_uuid(run_id))


def assert_contiguous(seqs: list[int]) -> None:
    """A journal's seqs are exactly 1..n: no gap, no duplicate."""
    assert seqs == list(range(1, len(seqs) + 1)), f"journal seqs are not 1..n: {seqs}"


async def assert_journal_sound(db: Db, run_id: UUID | str) -> list[asyncpg.Record]:
    """Seqs 1..n and at most one `complete`, which (if present) is the last event; returns
    the journal."""
    rows = await read_journal(db, run_id)
    assert_contiguous([r["seq"] for r in rows])
    completes = [r for r in rows if r["type"] == EventType.COMPLETE]
    assert len(completes) <= 1, f"run {run_id} has {len(completes)} complete events"
    if completes:
        assert rows[-1]["type"] == EventType.COMPLETE, \
            f"run {run_id}: events were journaled after the run's ending"
    return rows


def of_type(rows: list[asyncpg.Record], type: EventType) -> list[asyncpg.Record]:
    return [r for r in rows if r["type"] == type]


def streamed_text(rows: list[asyncpg.Record]) -> str:
    """The answer as a tail of the journal would show it: every content delta, in order."""
    return "".join(r["payload"]["delta"] for r in of_type(rows, EventType.CONTENT_DELTA))


async def journaled_deltas(db: Db, run_id: UUID | str) -> int:
    return await db.fetchval("SELECT count(*) FROM run_event WHERE run_id = $1"
                             " AND type = 'content_delta'", as_uuid(run_id))


async def run_row(db: Db, run_id: UUID | str) -> asyncpg.Record:
    row = await db.fetchrow("SELECT * FROM agent_run WHERE id = $1", as_uuid(run_id))
    assert row is not None, f"run {run_id} does not exist"
    return row


async def wait_status(db: Db, run_id: UUID, statuses: tuple[str, ...] | str, *,
                      timeout: float) -> asyncpg.Record:  # noqa: ASYNC109
    """Poll until the run's status is one of `statuses`; returns the row."""
    wanted = (statuses,) if isinstance(statuses, str) else statuses

    async def reached() -> asyncpg.Record | None:
        row = await run_row(db, run_id)
        return row if row["status"] in wanted else None

    return await poll_until(reached, timeout, what=f"run {run_id} to be {'/'.join(wanted)}")


async def assistant_messages(db: Db, run_id: UUID | str) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT id, content, status FROM message WHERE run_id = $1 AND role = 'assistant'"
        " ORDER BY position", as_uuid(run_id))


async def assistant_message(db: Db, run_id: UUID | str) -> asyncpg.Record:
    """The run's only assistant message."""
    rows = await assistant_messages(db, run_id)
    assert len(rows) == 1, f"run {run_id} has {len(rows)} assistant messages"
    return rows[0]
