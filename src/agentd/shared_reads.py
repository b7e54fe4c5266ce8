"""One read per wake: tails of the same run or conversation in this process share their reads.

A NOTIFY wakes every subscriber of a run in the same loop step; each then asks for the journal
after its cursor. Identical asks (same run, same cursor) join one query and fan its rows out.
A read is joinable only until its query is sent: one who joins saw every hint that arrived
before it, and whatever those hints announced was committed before the query went out, so the
shared rows are as fresh as a read of its own would be (rule 6: the rows stay the truth).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from datetime import datetime
from typing import Any, TypeVar
from uuid import UUID

import asyncpg

from agentd.conversations import runs_since
from agentd.queue import Event, read_events

T = TypeVar("T")


class _Flight:
    __slots__ = ("future", "joinable")

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future
        self.joinable = True


class SharedReads:
    """Single-flight journal and run-list reads for the tails of one process."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._flights: dict[Hashable, _Flight] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.asked = 0  # reads tails asked for
        self.issued = 0  # queries sent for them (asked - issued were shared)

    async def _shared(self, key: Hashable, query: Callable[[], Awaitable[T]]) -> T:
        self.asked += 1
        flight = self._flights.get(key)
        if flight is None or not flight.joinable:
            loop = asyncio.get_running_loop()
            flight = _Flight(loop.create_future())
            self._flights[key] = flight
            task = loop.create_task(self._fly(key, flight, query))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        # shield: one cancelled reader (a client gone) must not cancel the others' read.
        result: T = await asyncio.shield(flight.future)
        return result

    async def _fly(self, key: Hashable, flight: _Flight,
                   query: Callable[[], Awaitable[Any]]) -> None:
        # One loop step for the other subscribers the same hint woke to join, then close.
        await asyncio.sleep(0)
        flight.joinable = False
        if self._flights.get(key) is flight:
            del self._flights[key]
        self.issued += 1
        try:
            result = await query()
        except asyncio.CancelledError:
            flight.future.cancel()
            raise
        except Exception as exc:  # every reader sees the failure as its own read would
            flight.future.set_exception(exc)
            flight.future.exception()  # retrieved: no "never retrieved" noise if unread
            return
        flight.future.set_result(result)

    async def events(self, run_id: UUID, after_seq: int, limit: int) -> list[Event]:
        """The run's journal after `after_seq` (at most `limit` rows); a shared list: read only."""
        return await self._shared(
            ("events", run_id, after_seq, limit),
            lambda: read_events(self.pool, run_id, after_seq=after_seq, limit=limit))

    async def runs(self, conversation_id: UUID, watermark: tuple[datetime, UUID],
                   open_run_ids: list[UUID]) -> list[asyncpg.Record]:
        """A conversation's runs after the watermark plus the open ones (see runs_since)."""
        opened = tuple(sorted(open_run_ids))
        return await self._shared(
            ("runs", conversation_id, watermark, opened),
            lambda: runs_since(self.pool, conversation_id, watermark, list(opened)))
