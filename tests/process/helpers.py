"""What process tests need besides daemons: enqueue demo turns and read the rows they leave.

Everything is observed through the test's own connections; a daemon's memory is never trusted.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from uuid import UUID

import asyncpg

from agentd.accounts import ensure_account
from agentd.conversations import create_conversation
from agentd.providers.demo import expected_answer
from agentd.queue import enqueue_run
from agentd.vocabulary import EventType, RunStatus
from tests.daemon_harness import poll_until

Db = asyncpg.Pool | asyncpg.Connection
TERMINAL = tuple(str(s) for s in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED))
STARTED = (str(RunStatus.RUNNING), *TERMINAL)


@dataclass(frozen=True, slots=True)
class Turn:
    """One enqueued demo turn and what the demo model will answer to it."""

    run_id: UUID
    account_id: UUID
    conversation_id: UUID
    content: str
    tokens: int

    @property
    def expected(self) -> str:
        return expected_answer("demo", self.content, self.tokens)


async def new_account(db: Db) -> UUID:
    return await ensure_account(db, f"acct-{uuid.uuid4().hex[:10]}")


async def new_conversation(db: Db, account_id: UUID) -> UUID:
    return (await create_conversation(db, account_id, "process test")).id


async def enqueue_demo(db: Db, account_id: UUID, conversation_id: UUID, content: str, *,
                       tokens: int, delay_ms: int = 0) -> Turn:
    """Queue a demo turn answering `tokens` words, `delay_ms` apart."""
    params = {"tokens": tokens, "delay_ms": delay_ms}
    run = await enqueue_run(db, account_id=account_id, conversation_id=conversation_id,
                            content=content, request={"content": content, "params": params})
    return Turn(run.run_id, account_id, conversation_id, content, tokens)


async def run_row(db: Db, run_id: UUID) -> asyncpg.Record:
    row = await db.fetchrow("SELECT * FROM agent_run WHERE id = $1", run_id)
    assert row is not None, f"run {run_id} does not exist"
    return row


async def events(db: Db, run_id: UUID) -> list[asyncpg.Record]:
    """The run's journal in seq order."""
    return await db.fetch(
        "SELECT seq, type, payload, created_at FROM run_event WHERE run_id = $1 ORDER BY seq",
        run_id)


async def wait_status(db: Db, run_id: UUID, statuses: tuple[str, ...] | str, *,
                      timeout: float) -> asyncpg.Record:  # noqa: ASYNC109
    """Poll until the run's status is one of `statuses`; returns the row."""
    wanted = (statuses,) if isinstance(statuses, str) else statuses

    async def reached() -> asyncpg.Record | None:
        row = await run_row(db, run_id)
        return row if row["status"] in wanted else None

    return await poll_until(reached, timeout, what=f"run {run_id} to be {'/'.join(wanted)}")


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


def assert_journal_sound(rows: list[asyncpg.Record]) -> None:
    """Seqs are exactly 1..n and at most one `complete`, which is the last event."""
    seqs = [r["seq"] for r in rows]
    assert seqs == list(range(1, len(seqs) + 1)), f"journal seqs are not 1..n: {seqs}"
    completes = [r for r in rows if r["type"] == EventType.COMPLETE]
    assert len(completes) <= 1, f"{len(completes)} complete events"
    if completes:
        assert rows[-1]["type"] == EventType.COMPLETE, "events journaled after the ending"


def of_type(rows: list[asyncpg.Record], type: EventType) -> list[asyncpg.Record]:
    return [r for r in rows if r["type"] == type]


def streamed_text(rows: list[asyncpg.Record]) -> str:
    """The answer as a tail of the journal would show it: every content delta, in order."""
    return "".join(r["payload"]["delta"] for r in of_type(rows, EventType.CONTENT_DELTA))


async def assistant_messages(db: Db, run_id: UUID) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT id, content, status FROM message WHERE run_id = $1 AND role = 'assistant'"
        " ORDER BY position", run_id)


async def database_now(db: Db) -> object:
    return await db.fetchval("SELECT clock_timestamp()")
