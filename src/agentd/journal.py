"""The coalescing emitter: journals one run's events behind its fence (streams are tables with
cursors: docs/architecture.md).

Consecutive token deltas merge in memory and flush on a short clock; the first delta of a turn
and every structural event write through at once. A fenced-out write surfaces as LeaseLost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

import asyncpg

from agentd.db import UNAVAILABLE
from agentd.queue import (
    Appends,
    Claim,
    Db,
    Hint,
    Journaled,
    LeaseLost,
    NewEvent,
    SeqConflict,
    announce_landed,
    append_events,
    append_events_batched,
    read_events,
)
from agentd.vocabulary import EventType

DEFAULT_FLUSH_INTERVAL_S = 0.250
# A dropped connection (the database restarting, a failover) is retried within the lease; the
# fence decides whether a retry may still write.
# Shared with the terminal write (executor), which retries its transaction the same way.
RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0)
# A deadlock is retried too: a shared commit holds several runs' row locks until it commits.
# So is a wait for the run's row that outlasted lock_timeout (another transaction held it): the
# write rolled back, and the fence decides whether a retry, once the row is free, still writes.
TRANSIENT = (*UNAVAILABLE, asyncpg.exceptions.DeadlockDetectedError,
             asyncpg.exceptions.LockNotAvailableError)


class Emitter:
    """Owns seq for one execution of one run; not shared between tasks of other runs."""

    def __init__(self, db: Db, claim: Claim, *,
                 flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, hint: Hint | None = None,
                 appends: Appends | None = None,
                 journaled: Callable[[UUID, Journaled], None] | None = None) -> None:
        """`appends`: the process's shared journal writes (group commit); None writes each
        batch in its own commit. `journaled`: told the rows of each batch once committed (the
        process's own tails serve them without reading them back; shared_reads.py), before
        `hint` wakes those tails."""
        self._db = db
        self._appends = appends
        self._journaled = journaled
        self._claim = claim
        self._interval = flush_interval_s
        self._clock = clock
        self._hint = hint
        self._next_seq = claim.last_seq + 1
        self._pending: list[str] = []
        self._pending_since = 0.0
        self._generation = 0  # which pending buffer a timer was started for
        self._timer: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._first_delta_written = False
        self._lost: LeaseLost | None = None
        self.rows_written = 0
        self.deltas_seen = 0

    @property
    def next_seq(self) -> int:
        """The seq the next journaled event will take (the terminal write uses it)."""
        return self._next_seq

    @property
    def lost(self) -> LeaseLost | None:
        return self._lost

    async def delta(self, text: str) -> None:
        """Queue a content delta; the first of the turn is written at once."""
        self._raise_if_lost()
        if not text:
            return
        self.deltas_seen += 1
        if not self._first_delta_written:
            self._first_delta_written = True
            await self._write([_delta_event(text)])
            return
        if not self._pending:
            self._pending_since = self._clock()
            self._generation += 1
            self._timer = asyncio.create_task(self._flush_later(self._generation))
        self._pending.append(text)
        if self._clock() - self._pending_since >= self._interval:
            await self.flush()

    async def event(self, type: EventType, payload: dict[str, Any]) -> None:
        """Write a structural event through, after (and in one batch with) pending deltas."""
        self._raise_if_lost()
        await self._write([*self._take_pending(), (type, payload)])

    async def flush(self) -> None:
        """Write pending deltas now."""
        self._raise_if_lost()
        await self._write(self._take_pending())

    async def close(self) -> None:
        """Flush what is pending and stop the clock; raises LeaseLost if a write was fenced."""
        if self._timer is not None and not self._timer.done():
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        self._raise_if_lost()
        await self.flush()

    async def hand_over(self) -> list[NewEvent]:
        """Stop the clock and hand what is pending to the caller as a numbered batch, which it
        writes in the terminal write's own transaction (queue.finish_run_journaled); the
        emitter writes nothing more. Raises LeaseLost if a write was fenced."""
        if self._timer is not None and not self._timer.done():
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        async with self._lock:  # after any write in flight, so the seqs follow it
            self._raise_if_lost()
            batch = [NewEvent(self._next_seq + i, type, payload)
                     for i, (type, payload) in enumerate(self._take_pending())]
            self._next_seq += len(batch)
            self.rows_written += len(batch)
        return batch

    def _take_pending(self) -> list[tuple[EventType, dict[str, Any]]]:
        if not self._pending:
            return []
        text = "".join(self._pending)
        self._pending = []
        return [_delta_event(text)]

    async def _flush_later(self, generation: int) -> None:
        await asyncio.sleep(self._interval)
        if generation != self._generation or self._lost is not None:
            return
        with contextlib.suppress(LeaseLost):  # recorded in self._lost; the owner sees it next
            await self._write(self._take_pending())

    async def _write(self, events: list[tuple[EventType, dict[str, Any]]]) -> None:
        if not events:
            return
        # A batch taken from the buffer is written whatever happens to the caller: cancelled
        # while waiting for the lock, it would be lost (the message keeps text the journal
        # lacks); cancelled mid-append, the lock would go while the batch is half-known
        # (committed or not?) and the next write would reuse its seq. So the write runs as its
        # own task, and the caller's cancel is delivered once it has landed or failed.
        write = asyncio.ensure_future(self._write_in_order(events))
        cancelled = False
        while not write.done():
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                cancelled = True
            except Exception:
                break
        if cancelled:
            if not write.cancelled():
                # Retrieved, so asyncio does not log it as lost: a fenced-out batch is already
                # recorded in self._lost, which the owner checks next.
                write.exception()
            raise asyncio.CancelledError
        write.result()

    async def _write_in_order(self, events: list[tuple[EventType, dict[str, Any]]]) -> None:
        async with self._lock:
            self._raise_if_lost()
            await self._append(events)

    async def _append(self, events: list[tuple[EventType, dict[str, Any]]]) -> None:
        batch = [NewEvent(self._next_seq + i, type, payload)
                 for i, (type, payload) in enumerate(events)]
        shared = self._appends
        for attempt in range(len(RETRY_DELAYS_S) + 1):
            try:
                if shared is not None:
                    await append_events_batched(shared, self._claim, batch,
                                                hint=self._hint, journaled=self._journaled)
                else:
                    await append_events(self._db, self._claim, batch, hint=self._hint)
                    if self._journaled is not None:  # landed, its rows unread
                        self._journaled(self._claim.run_id, ())
                break
            except SeqConflict as exc:
                # After a connection died mid-commit, our own earlier attempt may have landed.
                if attempt and await self._landed(batch):
                    # Its wake is owed; a wake that fails leaves the readers to their poll,
                    # while the batch stands and the seq moves past it.
                    with contextlib.suppress(*TRANSIENT):
                        await announce_landed(self._db, self._claim.run_id, self._hint,
                                              self._journaled)
                    break
                self._lost = exc
                raise
            except LeaseLost as exc:
                self._lost = exc
                raise
            except Exception as exc:
                if isinstance(exc, TRANSIENT) and attempt < len(RETRY_DELAYS_S):
                    # A run whose row is held retries in a statement of its own: in a shared
                    # one, each retry would hold every other run of it for a lock_timeout too.
                    if isinstance(exc, asyncpg.LockNotAvailableError):
                        shared = None
                    await asyncio.sleep(RETRY_DELAYS_S[attempt])
                    continue
                # The journal can no longer be vouched for: stop writing to it, so nothing
                # (an answer included) is stored that its readers did not see.
                self._lost = LeaseLost(self._claim.run_id, f"journal append ({exc})")
                raise self._lost from exc
        self._next_seq += len(batch)
        self.rows_written += len(batch)

    async def _landed(self, batch: list[NewEvent]) -> bool:
        """Whether exactly this batch is already in the journal at its seqs."""
        try:
            found = await read_events(self._db, self._claim.run_id,
                                      after_seq=batch[0].seq - 1, limit=len(batch))
        except TRANSIENT:
            return False
        return [(e.seq, e.type, e.payload) for e in found] == \
            [(e.seq, e.type, json.loads(json.dumps(e.payload))) for e in batch]

    def _raise_if_lost(self) -> None:
        if self._lost is not None:
            raise self._lost


def _delta_event(text: str) -> tuple[EventType, dict[str, Any]]:
    return (EventType.CONTENT_DELTA, {"delta": text})
