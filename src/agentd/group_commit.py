"""Group commit: journal writes of many runs that arrive while one commit is under way share the
next transaction, so N turns streaming at once cost a few WAL flushes per clock tick, not N.

Each write runs in its own savepoint with its own fence (claim token, status, deadline): one
that is refused (LeaseLost, a seq taken) rolls back alone and its caller gets the same error a
transaction of its own would have raised, after the group committed. A failed commit fails every
write of the group, as each one's own failed commit would have. An idle process waits for
nothing: a write with no group in flight starts one at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

T = TypeVar("T")
Work = Callable[[asyncpg.Connection], Awaitable[Any]]


class GroupCommit:
    """Runs `work(conn)` callables in shared transactions, at most `max_in_flight` at a time."""

    def __init__(self, pool: asyncpg.Pool, *, max_group: int = 128,
                 max_in_flight: int = 2) -> None:
        self.pool = pool
        self._max_group = max_group
        self._max_in_flight = max_in_flight
        self._queue: list[tuple[Work, asyncio.Future[Any]]] = []
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.groups = 0  # transactions committed (or tried)
        self.writes = 0  # writes they carried

    async def run(self, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        """`work` in the next group's transaction; its result once that group committed."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.append((work, future))
        self._start_groups()
        return await future

    def _start_groups(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue and self._in_flight < self._max_in_flight:
            group = self._queue[:self._max_group]
            del self._queue[:self._max_group]
            self._in_flight += 1
            task = loop.create_task(self._commit(group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _commit(self, group: list[tuple[Work, asyncio.Future[Any]]]) -> None:
        try:
            self.groups += 1
            self.writes += len(group)
            outcomes: list[tuple[asyncio.Future[Any], BaseException | None, Any]] = []
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    for work, future in group:
                        try:
                            async with conn.transaction():  # a savepoint: refused alone
                                outcomes.append((future, None, await work(conn)))
                        except Exception as exc:
                            outcomes.append((future, exc, None))
            except asyncio.CancelledError:
                for _, future in group:
                    future.cancel()
                raise
            except Exception as exc:
                for _, future in group:
                    if not future.done():
                        future.set_exception(exc)
                return
            for future, error, result in outcomes:
                if future.done():  # its caller was cancelled; the write stands or fell alone
                    continue
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
        finally:
            self._in_flight -= 1
            self._start_groups()
