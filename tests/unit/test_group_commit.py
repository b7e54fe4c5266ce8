"""The batcher's promise to its callers (group_commit.Batcher): each gets an answer, whatever
its batch's writer does."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from agentd.group_commit import Batcher

DEADLINE_S = 10.0


async def test_a_writer_answering_for_too_few_items_leaves_no_caller_waiting() -> None:
    async def short(items: Sequence[int]) -> list[int | Exception]:
        return [item * 10 for item in items[:1]]  # one outcome for a batch of three

    group: Batcher[int, int] = Batcher(None, short)
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(group.submit(i) for i in (1, 2, 3)), return_exceptions=True),
        DEADLINE_S)
    assert group.batches == 1
    assert outcomes[0] == 10
    assert all(isinstance(o, Exception) for o in outcomes[1:])


class Stop(BaseException):
    """Not an Exception: it passes every `except Exception`."""


async def test_a_writer_stopped_by_something_else_than_an_error_still_answers_everyone() -> None:
    async def stopped(items: Sequence[int]) -> list[int | Exception]:
        raise Stop

    group: Batcher[int, int] = Batcher(None, stopped)
    callers = [asyncio.ensure_future(group.submit(i)) for i in (1, 2)]
    done, _ = await asyncio.wait(callers, timeout=DEADLINE_S)
    assert len(done) == 2
    for caller in callers:
        with pytest.raises(RuntimeError):
            caller.result()
