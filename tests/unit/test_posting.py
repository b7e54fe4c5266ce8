"""A post's transaction (service.Service._posting): a COMMIT whose answer was lost is AnswerLost,
for the caller to look for the turn by its claim's key, even when the pool then fails to
release the broken connection (its rollback sent on a dead link). Before, the release's error
replaced AnswerLost: the turn, committed and running under this process, was never looked for
and stayed running with nobody to execute it until the reaper failed it."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import asyncpg
import pytest

from agentd.queue import AnswerLost
from agentd.service import Service

COMMIT_LOST = asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of "
                                                  "operation")


class _Transaction:
    def __init__(self, commit_lost: bool) -> None:
        self.commit_lost = commit_lost

    async def start(self) -> None:
        pass

    async def rollback(self) -> None:
        pass

    async def commit(self) -> None:
        if self.commit_lost:
            raise COMMIT_LOST


class _Connection:
    def __init__(self, commit_lost: bool) -> None:
        self.commit_lost = commit_lost

    def transaction(self) -> _Transaction:
        return _Transaction(self.commit_lost)


class _Lending:
    """pool.acquire(): lends a connection; giving it back fails when `release_fails`."""

    def __init__(self, release_fails: bool, commit_lost: bool) -> None:
        self.release_fails = release_fails
        self.commit_lost = commit_lost

    async def __aenter__(self) -> _Connection:
        return _Connection(self.commit_lost)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.release_fails:
            raise asyncpg.InterfaceError("the connection is broken: cannot roll it back")


class _Pool:
    def __init__(self, release_fails: bool, commit_lost: bool) -> None:
        self.release_fails = release_fails
        self.commit_lost = commit_lost

    def acquire(self) -> _Lending:
        return _Lending(self.release_fails, self.commit_lost)


def _service(release_fails: bool, commit_lost: bool = True) -> Service:
    pool: Any = _Pool(release_fails, commit_lost)
    return Service(pool, hub=None, settings=None, tools=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("release_fails", [False, True])
async def test_a_commit_whose_answer_was_lost_is_answer_lost_whatever_the_release_does(
        release_fails: bool) -> None:
    slot: Any = object()  # a claim beside the post: its commit's doubt matters
    with pytest.raises(AnswerLost) as raised:
        async with _service(release_fails)._posting(slot):
            pass
    assert raised.value.cause is COMMIT_LOST


async def test_without_a_claim_beside_it_a_lost_commit_is_raised_as_itself() -> None:
    with pytest.raises(asyncpg.ConnectionDoesNotExistError):
        async with _service(False)._posting(None):
            pass


async def test_a_commit_that_landed_is_not_hidden_by_a_failed_release() -> None:
    """The COMMIT answered: the turn is written (and, with a claim beside it, started here).
    A release that fails afterwards is logged; the post goes on to answer with its turn."""
    slot: Any = object()
    async with _service(release_fails=True, commit_lost=False)._posting(slot):
        pass  # no error leaves it
