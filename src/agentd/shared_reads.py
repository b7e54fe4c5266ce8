"""One read per wake: tails of the same run or conversation in this process share their reads.

A NOTIFY wakes every subscriber of a run in the same loop step; each then asks for the journal
after its cursor. Identical asks (same run, same cursor) join one query and fan its rows out;
the asks of different runs made in the same loop step go out together in one query.
A read is joinable only until its query is sent: one who joins saw every hint that arrived
before it, and whatever those hints announced was committed before the query went out, so the
shared rows are as fresh as a read of its own would be (rule 6: the rows stay the truth).

And the rows this process writes itself need no read at all: once a journal batch has
committed, its writer hands the rows over (`journaled`: exactly what a read would return,
stamps included) before it wakes the run's tails here. A tail woken only by such hints takes
the rows that follow its cursor from here; any other wake (another process wrote, a
reconnect, a poll, a gap in what is held) reads the database as before.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from datetime import datetime
from typing import Any, TypeVar
from uuid import UUID

import asyncpg

from agentd.conversations import runs_since
from agentd.queue import Event, read_events, read_events_many
from agentd.vocabulary import EventType

T = TypeVar("T")


class _Flight:
    __slots__ = ("future", "joinable")

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future
        self.joinable = True


# The newest rows kept per run this process writes, and how many runs are kept (least recently
# written first out): a tail further behind than this reads the database.
HELD_ROWS_PER_RUN = 64
HELD_RUNS = 20_000


class SharedReads:
    """Single-flight journal and run-list reads for the tails of one process, and the rows
    this process's own writers have just committed."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._held: OrderedDict[UUID, deque[Event]] = OrderedDict()
        self.served_held = 0  # reads answered from rows at hand
        self._flights: dict[Hashable, _Flight] = {}
        # Event reads for the next query: run, cursor, limit, flight key, flight.
        self._batch: list[tuple[UUID, int, int, Hashable, _Flight]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.asked = 0  # reads tails asked for
        self.issued = 0  # queries sent for them (asked - issued were shared)

    def journaled(self, run_id: UUID, rows: Sequence[Event]) -> None:
        """Rows of the run's journal this process has just committed, in seq order."""
        held = self._held.get(run_id)
        if held is None:
            held = self._held[run_id] = deque(maxlen=HELD_ROWS_PER_RUN)
            if len(self._held) > HELD_RUNS:
                self._held.popitem(last=False)
        else:
            self._held.move_to_end(run_id)
            if held and rows[0].seq != held[-1].seq + 1:
                held.clear()  # a batch went by unseen: what is held no longer follows on
        held.extend(rows)
        if rows[-1].type == EventType.COMPLETE:
            del self._held[run_id]

    def held_after(self, run_id: UUID, after_seq: int) -> list[Event] | None:
        """The run's rows after `after_seq` that this process wrote and holds, when they follow
        on from it with nothing missing in between ([] when it holds nothing newer); None when
        they do not (read the database)."""
        held = self._held.get(run_id)
        if not held or held[0].seq > after_seq + 1:
            return None
        self.served_held += 1
        return [e for e in held if e.seq > after_seq]

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
        """The run's journal after `after_seq` (at most `limit` rows); a shared list: read only.

        Reads of different runs asked in the same loop step go out as ONE query too (a group
        commit of many runs' deltas wakes all their tails at once)."""
        self.asked += 1
        key = ("events", run_id, after_seq, limit)
        flight = self._flights.get(key)
        if flight is None or not flight.joinable:
            loop = asyncio.get_running_loop()
            flight = _Flight(loop.create_future())
            self._flights[key] = flight
            self._batch.append((run_id, after_seq, limit, key, flight))
            if len(self._batch) == 1:
                task = loop.create_task(self._fly_events())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        result: list[Event] = await asyncio.shield(flight.future)
        return result

    async def _fly_events(self) -> None:
        await asyncio.sleep(0)  # one loop step for the others the same hints woke
        batch, self._batch = self._batch, []
        by_limit: dict[int, list[tuple[tuple[UUID, int], _Flight]]] = {}
        for run_id, after_seq, limit, key, flight in batch:
            flight.joinable = False
            if self._flights.get(key) is flight:
                del self._flights[key]
            by_limit.setdefault(limit, []).append(((run_id, after_seq), flight))
        for limit, flights in by_limit.items():
            self.issued += 1
            cursors = [cursor for cursor, _ in flights]
            try:
                if len(cursors) == 1:
                    results = [await read_events(self.pool, cursors[0][0],
                                                 after_seq=cursors[0][1], limit=limit)]
                else:
                    results = await read_events_many(self.pool, cursors, limit)
            except asyncio.CancelledError:
                for _, flight in flights:
                    flight.future.cancel()
                raise
            except Exception as exc:  # every reader sees the failure as its own read would
                for _, flight in flights:
                    flight.future.set_exception(exc)
                    flight.future.exception()
                continue
            for (_, flight), events in zip(flights, results, strict=True):
                flight.future.set_result(events)

    async def runs(self, conversation_id: UUID, watermark: tuple[datetime, UUID],
                   open_run_ids: list[UUID]) -> list[asyncpg.Record]:
        """A conversation's runs after the watermark plus the open ones (see runs_since)."""
        opened = tuple(sorted(open_run_ids))
        return await self._shared(
            ("runs", conversation_id, watermark, opened),
            lambda: runs_since(self.pool, conversation_id, watermark, list(opened)))
