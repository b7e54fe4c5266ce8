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
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
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


# One event read asked for: run, cursor, limit, its flight's key, its flight.
_Ask = tuple[UUID, int, int, Hashable, _Flight]


# The newest rows kept per run this process writes, how many runs are kept, and how much text
# they may carry all together (a tool result alone may be 100,000 characters): past either
# bound the least recently written runs go first. A tail further behind reads the database.
HELD_ROWS_PER_RUN = 64
HELD_RUNS = 20_000
HELD_CHARS = 32_000_000


class _Held:
    """One run's newest rows written here, and the characters of text they carry."""

    __slots__ = ("chars", "rows")

    def __init__(self) -> None:
        self.rows: deque[Event] = deque()
        self.chars = 0


class SharedReads:
    """Single-flight journal and run-list reads for the tails of one process, and the rows
    this process's own writers have just committed."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._held: OrderedDict[UUID, _Held] = OrderedDict()
        self.held_chars = 0  # the text all held rows carry
        self.served_held = 0  # reads answered from rows at hand
        self._flights: dict[Hashable, _Flight] = {}
        # Event reads for the next query, closed (replaced by a new list) once it is sent.
        self._batch: list[_Ask] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.asked = 0  # reads tails asked for
        self.issued = 0  # queries sent for them (asked - issued were shared)

    def journaled(self, run_id: UUID, rows: Sequence[Event]) -> None:
        """Rows of the run's journal this process has just committed, in seq order; none when
        a batch committed without its rows at hand (then what is held no longer follows on,
        and the run's tails read the database)."""
        if not rows:
            self.ended(run_id)
            return
        held = self._held.get(run_id)
        if held is None:
            held = self._held[run_id] = _Held()
        else:
            self._held.move_to_end(run_id)
            if held.rows and rows[0].seq != held.rows[-1].seq + 1:
                self._drop(held, len(held.rows))  # a batch went by unseen
        for row in rows:
            chars = _chars(row.payload)
            held.rows.append(row)
            held.chars += chars
            self.held_chars += chars
        self._drop(held, len(held.rows) - HELD_ROWS_PER_RUN)
        if rows[-1].type == EventType.COMPLETE:
            self.ended(run_id)
        while self._held and (len(self._held) > HELD_RUNS or self.held_chars > HELD_CHARS):
            self._forget(next(iter(self._held)))

    def ended(self, run_id: UUID) -> None:
        """The run ended in this process (finished, or its lease lost): its rows are let go.
        Its `complete` is written by the terminal write in SQL and is never handed over."""
        if run_id in self._held:
            self._forget(run_id)

    def _forget(self, run_id: UUID) -> None:
        self.held_chars -= self._held.pop(run_id).chars

    def _drop(self, held: _Held, count: int) -> None:
        """Let go of the run's `count` oldest rows."""
        for _ in range(max(count, 0)):
            chars = _chars(held.rows.popleft().payload)
            held.chars -= chars
            self.held_chars -= chars

    def held_after(self, run_id: UUID, after_seq: int) -> list[Event] | None:
        """The run's rows after `after_seq` that this process wrote and holds, when they follow
        on from it with nothing missing in between ([] when it holds nothing newer); None when
        they do not (read the database)."""
        held = self._held.get(run_id)
        if held is None or not held.rows or held.rows[0].seq > after_seq + 1:
            return None
        self.served_held += 1
        return [e for e in held.rows if e.seq > after_seq]

    def held_runs(self) -> int:
        """How many runs have rows held here."""
        return len(self._held)

    async def _shared(self, key: Hashable, query: Callable[[], Awaitable[T]]) -> T:
        self.asked += 1
        flight = self._flights.get(key)
        if flight is None or not flight.joinable:
            loop = asyncio.get_running_loop()
            flight = fresh = _Flight(loop.create_future())
            self._flights[key] = fresh
            self._start(self._fly(key, fresh, query), lambda ended: self._abandon(
                [(key, fresh)], ended))
        # shield: one cancelled reader (a client gone) must not cancel the others' read.
        result: T = await asyncio.shield(flight.future)
        return result

    async def _fly(self, key: Hashable, flight: _Flight,
                   query: Callable[[], Awaitable[Any]]) -> None:
        # One loop step for the other subscribers the same hint woke to join, then close. A
        # query that fails fails the task, and _abandon hands its error to every reader.
        await asyncio.sleep(0)
        self._close(key, flight)
        self.issued += 1
        flight.future.set_result(await query())

    def _start(self, read: Coroutine[Any, Any, None],
               abandon: Callable[[asyncio.Task[None]], None]) -> None:
        """Send a read in a task of its own; `abandon` runs when the task ends, however it ends
        (a task cancelled before its first step runs none of its code, so a `finally` in it
        would not do)."""
        task = asyncio.get_running_loop().create_task(read)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(abandon)

    def _close(self, key: Hashable, flight: _Flight) -> None:
        """No one joins the flight from now on (its query is about to go out)."""
        flight.joinable = False
        if self._flights.get(key) is flight:
            del self._flights[key]

    def _abandon(self, flights: Sequence[tuple[Hashable, _Flight]],
                 ended: asyncio.Task[None]) -> None:
        """The task that was to answer these flights has ended: close them, and tell whoever
        still waits (it was cancelled, as when the loop closes, or failed), who would otherwise
        wait for ever while later askers joined them."""
        failure = None if ended.cancelled() else ended.exception()
        for key, flight in flights:
            self._close(key, flight)
            if flight.future.done():
                continue
            if failure is None:
                flight.future.cancel()
            else:
                _fail(flight, failure)

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
            batch = self._batch
            batch.append((run_id, after_seq, limit, key, flight))
            if len(batch) == 1:
                self._start(self._fly_events(batch), lambda ended: self._abandon(
                    self._seal(batch), ended))
        result: list[Event] = await asyncio.shield(flight.future)
        return result

    async def _fly_events(self, batch: list[_Ask]) -> None:
        await asyncio.sleep(0)  # one loop step for the others the same hints woke
        by_limit: dict[int, list[tuple[tuple[UUID, int], _Flight]]] = {}
        self._seal(batch)
        for run_id, after_seq, limit, _, flight in batch:
            by_limit.setdefault(limit, []).append(((run_id, after_seq), flight))
        for limit, flights in by_limit.items():
            await self._read_events(limit, flights)

    def _seal(self, batch: list[_Ask]) -> list[tuple[Hashable, _Flight]]:
        """Close the batch to joiners (the next ask starts another) and return its flights."""
        if self._batch is batch:
            self._batch = []
        for _, _, _, key, flight in batch:
            self._close(key, flight)
        return [(key, flight) for _, _, _, key, flight in batch]

    async def _read_events(self, limit: int,
                           flights: list[tuple[tuple[UUID, int], _Flight]]) -> None:
        """Read the flights' journals in one query and answer each flight."""
        self.issued += 1
        cursors = [cursor for cursor, _ in flights]
        results: list[list[Event] | ValueError]
        try:
            if len(cursors) == 1:
                results = [await read_events(self.pool, cursors[0][0],
                                             after_seq=cursors[0][1], limit=limit)]
            else:
                results = await read_events_many(self.pool, cursors, limit)
        except Exception as exc:
            for _, flight in flights:  # each reader sees the failure its own read would
                _fail(flight, exc)
            return
        for (_, flight), events in zip(flights, results, strict=True):
            if isinstance(events, ValueError):  # this run's rows only (read_events_many)
                _fail(flight, events)
            else:
                flight.future.set_result(events)

    async def runs(self, conversation_id: UUID, watermark: tuple[datetime, UUID],
                   open_run_ids: list[UUID]) -> list[asyncpg.Record]:
        """A conversation's runs after the watermark plus the open ones (see runs_since)."""
        opened = tuple(sorted(open_run_ids))
        return await self._shared(
            ("runs", conversation_id, watermark, opened),
            lambda: runs_since(self.pool, conversation_id, watermark, list(opened)))


def _fail(flight: _Flight, exc: BaseException) -> None:
    flight.future.set_exception(exc)
    flight.future.exception()  # retrieved: no "never retrieved" noise if no one reads it


def _chars(value: Any) -> int:
    """The characters of text in a row's payload (its strings and keys): what holding it costs,
    near enough."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + _chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 8
