"""An ending's wake that went to its own process's claim loop alone (notifier.py) is handed on
to the fleet when that loop cannot act on it: the slot the ending gave back went to a post's
claim beside its enqueue, overload began after the notifier decided, or the loop's claim failed.
Without that, what the ending freed waited for another process's tick (here an hour away)
although other processes had free slots.

Each "process" is a claim loop wired as runtime.py wires one (its own hub, notifier, load
monitor and dispatcher) in this test's event loop; a listener stands for the fleet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any
from uuid import UUID

import asyncpg
import pytest

from agentd import dispatcher as dispatcher_module
from agentd.dispatcher import Dispatcher
from agentd.hub import Hub
from agentd.load import LoadMonitor
from agentd.metrics import Metrics
from agentd.notifier import Notifier
from agentd.queue import Claim, EnqueuedRun, finish_run
from agentd.settings import Settings
from agentd.vocabulary import Channel, RunStatus
from tests.integration.helpers import DEFAULT_TIMEOUT_S, Listener, listening
from tests.support.daemon import poll_until
from tests.support.factories import enqueue, new_tenant, post_beside
from tests.support.journal import run_row

NO_TICK = {"tick_s": 3600.0}  # a loop claims only when woken


class Process:
    """One daemon's claiming parts; each turn runs until the test lets it end."""

    def __init__(self, name: str, pool: asyncpg.Pool, dsn: str, max_runs: int,
                 after_turn: Callable[[Claim], None] = lambda claim: None) -> None:
        self.name = f"vm:{name}"
        self.pool = pool
        self.hub = Hub(dsn)
        self.metrics = Metrics()
        settings = Settings(max_runs=max_runs, **NO_TICK)
        self.load = LoadMonitor(pool, self.metrics,
                                max_loop_lag_s=settings.max_loop_lag_ms / 1000,
                                max_pool_wait_s=settings.max_pool_wait_ms / 1000)
        self.notifier = Notifier(pool, local=self.hub, claim_loop=lambda: self.dispatcher)
        self.dispatcher = Dispatcher(pool, self.hub, settings, self.name, self._run_turn,
                                     self.load, self.metrics, hint=self.notifier.notify)
        self._after_turn = after_turn
        self._ends: dict[UUID, asyncio.Event] = {}

    async def _run_turn(self, claim: Claim) -> bool:
        await self._end(claim.run_id).wait()
        await finish_run(self.pool, claim, RunStatus.COMPLETED, seq=None,
                         hint=self.notifier.notify)
        self._after_turn(claim)
        return True

    def _end(self, run_id: UUID) -> asyncio.Event:
        return self._ends.setdefault(run_id, asyncio.Event())

    async def end(self, run_id: UUID) -> None:
        """Let the turn end, and return once its task is over (its slot given back)."""
        [task] = [t for t in self.dispatcher.in_flight if t.get_name() == f"run-{run_id}"]
        self._end(run_id).set()
        await task

    async def post(self, account_id: UUID, conversation_id: UUID, content: str) -> EnqueuedRun:
        """A post with a free slot of this process, started beside its enqueue."""
        slot = await self.dispatcher.reserve()
        assert slot is not None, f"{self.name} has a free slot"
        run, claims = await post_beside(self.pool, account_id, conversation_id, content,
                                        slot.terms.worker_id, slot.terms.lease_ttl_s)
        slot.settle(claims)
        assert [c.run_id for c in claims] == [run.run_id], f"{content} started beside its post"
        return run

    async def start(self, *, watch_load: bool = False) -> None:
        await self.hub.start()
        self.notifier.start()
        if watch_load:
            self.load.start()
        self.dispatcher.start()

    async def close(self) -> None:
        for end in self._ends.values():
            end.set()
        await self.dispatcher.stop_claiming()
        await self.dispatcher.drain(DEFAULT_TIMEOUT_S)
        await self.notifier.close()
        await self.load.close()
        await self.hub.close()


@pytest.fixture
def claims_made(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The claim loops' claim statements, counted (and made to fail while `fail` is set)."""
    state: dict[str, Any] = {"calls": 0, "fail": False}
    real = dispatcher_module.claim_runs

    async def claim_runs(db: Any, **kwargs: Any) -> list[Claim]:
        state["calls"] += 1
        if state["fail"]:
            raise OSError("the database went away")
        return await real(db, **kwargs)

    monkeypatch.setattr(dispatcher_module, "claim_runs", claim_runs)
    yield state


async def _status(pool: asyncpg.Pool, run_id: UUID) -> tuple[str, str | None]:
    row = await run_row(pool, run_id)
    return row["status"], row["worker_id"]


async def _started_by(pool: asyncpg.Pool, run_id: UUID) -> str:
    async def started() -> bool:
        return (await _status(pool, run_id))[0] != RunStatus.QUEUED

    await poll_until(started, DEFAULT_TIMEOUT_S, interval=0.005,
                     what=f"run {run_id} to start (no loop ticks: only a wake can start it)")
    status, worker = await _status(pool, run_id)
    assert status == RunStatus.RUNNING
    assert worker is not None
    return worker


async def _heard_after(fleet: Listener, what: str) -> str:
    """The next wake the fleet hears (anything heard before is dropped)."""
    try:
        return await fleet.next(DEFAULT_TIMEOUT_S)
    except TimeoutError:
        raise AssertionError(f"no claim loop of the fleet was woken {what}") from None


async def _settled(claims_made: dict[str, Any]) -> None:
    """Until the claim loops have answered every wake so far (no claim for 0.2 s)."""
    seen, since = claims_made["calls"], time.monotonic()
    while time.monotonic() - since < 0.2:
        await asyncio.sleep(0.01)
        if claims_made["calls"] != seen:
            seen, since = claims_made["calls"], time.monotonic()


async def test_a_post_that_takes_the_slot_an_ending_gave_back_hands_its_wake_on(
        pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any]) -> None:
    """P1 (two slots) runs T1 and X; Q waits behind T1 in its conversation. T1 ends, and a
    post to P1 takes the slot T1 gave back before P1's loop has heard of the ending (the
    post's account is served first, so its claim beside keeps its own turn). P1's loop owes
    the ending's wake and has no slot: it hands the wake on, and P2 starts Q."""
    p1 = Process("p1", pool, dsn, max_runs=2)
    p2 = Process("p2", pool, dsn, max_runs=4)
    a, b, c = [await new_tenant(pool, name) for name in ("owed-a", "owed-b", "owed-c")]
    await p1.start()
    await p2.start()
    await _settled(claims_made)  # each loop's first claim found nothing
    try:
        t1 = await p1.post(a.account_id, a.conversation_id, "t1")
        q = await enqueue(pool, a.account_id, a.conversation_id, "q")  # held behind t1
        await _settled(claims_made)  # the loops, woken by q, found nothing and hold no slot
        await p1.post(b.account_id, b.conversation_id, "x")  # p1 is full
        assert await _status(pool, q.run_id) == (RunStatus.QUEUED, None)
        async with listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
            await p1.end(t1.run_id)
            await p1.post(c.account_id, c.conversation_id, "y")  # takes t1's slot
            assert await _heard_after(fleet, "for the turn t1 freed") == "no free slot"
        assert await _started_by(pool, q.run_id) == p2.name
    finally:
        await p1.close()
        await p2.close()


async def test_overload_after_the_wake_was_decided_hands_it_on(
        pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any]) -> None:
    """T1's task ends with 400 ms of work on P1's event loop (any coroutine's), longer than
    max_loop_lag_ms: the notifier decides while the lag is not yet recorded, P1's loop then
    holds back for it. The fleet hears of what T1 freed all the same (as the loop's hand-on,
    or as the notifier's own NOTIFY when the lag was recorded first)."""
    ended: list[UUID] = []

    def busy_after(claim: Claim) -> None:
        if claim.run_id in ended:
            time.sleep(0.4)  # blocks the event loop, as a burst of CPU work does

    p1 = Process("p1", pool, dsn, max_runs=2, after_turn=busy_after)
    a = await new_tenant(pool, "overloaded")
    await p1.start(watch_load=True)
    await _settled(claims_made)
    try:
        t1 = await p1.post(a.account_id, a.conversation_id, "t1")
        q = await enqueue(pool, a.account_id, a.conversation_id, "q")  # held behind t1
        await _settled(claims_made)
        assert p1.load.overload() is None
        async with listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
            ended.append(t1.run_id)
            await p1.end(t1.run_id)
            assert await _heard_after(fleet, "for the turn t1 freed") in (
                "overloaded", str(a.conversation_id))
        assert await _started_by(pool, q.run_id) == p1.name  # once it is admitted again
    finally:
        await p1.close()


async def test_a_failed_claim_hands_its_owed_wake_on(
        pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any]) -> None:
    """P1's claim after T1's ending fails (the database answered with an error): its loop
    waits a tick, and the fleet is told instead."""
    p1 = Process("p1", pool, dsn, max_runs=2)
    a = await new_tenant(pool, "failing")
    await p1.start()
    await _settled(claims_made)
    try:
        t1 = await p1.post(a.account_id, a.conversation_id, "t1")
        await enqueue(pool, a.account_id, a.conversation_id, "q")  # held behind t1
        await _settled(claims_made)
        async with listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
            claims_made["fail"] = True
            await p1.end(t1.run_id)
            assert await _heard_after(fleet, "for the turn t1 freed") == "claim failed"
    finally:
        claims_made["fail"] = False
        await p1.close()
