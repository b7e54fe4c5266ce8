"""Group commit: writes of many runs that arrive while a commit is under way share the next one,
so N turns streaming at once cost a few WAL flushes per clock tick, not N.

`Batcher` is the mechanism: items submitted while `max_in_flight` batches are being written wait
and go together into the next batch; an idle process waits for nothing (a lone item starts a
batch at once). A batch is cut when its writer task starts, one turn of the event loop after the
first item asked for it, so items submitted in the same turn (the turns of one claim ending
together) share it instead of filling every free writer with one item each.

Its writer returns one outcome per item: each caller gets the result or the error its own write
would have had. Journal appends use it with one statement for the whole batch
(queue.append_events_many), and so do terminal writes (queue.finish_runs), each run fenced on
its own in that statement: one refused is missing from its answer while the others land. A
statement that fails for what one item brought (a seq someone took, a value PostgreSQL
refuses, a row another transaction held past lock_timeout) is written again one item at a
time, each with its own outcome, so only that item gets the error (or the wait); one that
fails for the database's state (a lost connection, a shutdown, a deadlock) fails every item of
its batch, as each one's own failed commit would have. Every caller gets an answer, whatever
stops a writer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

I = TypeVar("I")  # noqa: E741 - an item
R = TypeVar("R")


class Batcher(Generic[I, R]):
    """Submit items; `write(items)` writes each batch and returns an outcome per item."""

    def __init__(self, db: Any,
                 write: Callable[[Sequence[I]], Awaitable[Sequence[R | Exception]]], *,
                 max_batch: int = 64, max_in_flight: int = 4) -> None:
        self.db = db  # where the batches go (hints after them are sent there too)
        self._write = write
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._queue: list[tuple[I, asyncio.Future[R]]] = []
        self._in_flight = 0  # writer tasks started or about to start
        self._cutting = False  # one of them has not cut its batch yet
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0  # batches written (or tried)
        self.items = 0  # items they carried

    async def submit(self, item: I) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        self._start_batches()
        return await future

    def _start_batches(self) -> None:
        # At most one writer waits to cut a batch: what is submitted until it starts joins it.
        if self._queue and not self._cutting and self._in_flight < self._max_in_flight:
            self._in_flight += 1
            self._cutting = True
            task = asyncio.get_running_loop().create_task(self._run())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        batch = self._queue[:self._max_batch]
        del self._queue[:self._max_batch]
        self._cutting = False
        self._start_batches()  # what did not fit goes to the next writer, if one is free
        try:
            self.batches += 1
            self.items += len(batch)
            try:
                outcomes = await self._write([item for item, _ in batch])
                for (_, future), outcome in zip(batch, outcomes, strict=True):
                    if future.done():  # its caller was cancelled; the write stands or fell alone
                        continue
                    if isinstance(outcome, Exception):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
            except asyncio.CancelledError:
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as exc:  # the write failed, or answered for too few or too many
                _answer_the_rest(batch, exc)
        finally:
            # Whatever stopped this writer, no caller is left waiting for an answer forever.
            _answer_the_rest(batch, RuntimeError("group commit: the batch's writer stopped "
                                                 "without an outcome for this item"))
            self._in_flight -= 1
            self._start_batches()


def _answer_the_rest(batch: Sequence[tuple[Any, asyncio.Future[Any]]], exc: Exception) -> None:
    """Give every item of the batch not answered yet `exc` as its outcome."""
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)
