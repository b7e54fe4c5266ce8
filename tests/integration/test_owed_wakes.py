"""An ending's wake that went to its own process's claim loop alone (notifier.py) is handed on
to the fleet when that loop cannot act on it: the slot the ending gave back went to a post's
claim beside its enqueue, overload began after the notifier decided, or the loop's claim failed;
whether the loop comes to claim after the wake arrives or was parked (on a slot, on the load)
when it came. Without that, what the ending freed waited for another process's tick (here an
hour away) although other processes had free slots.

Each "process" is a claim loop wired as runtime.py wires one (its own hub, notifier, load
monitor and dispatcher; the wakes owed to it counted) in this test's event loop; a listener
stands for the fleet. The notifier's statement can be held after it has decided
(`held_wakes`), so the loop can be put where the wake is to find it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import asyncpg
import pytest

from agentd import dispatcher as dispatcher_module
from agentd import notifier as notifier_module
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
from tests.support.factories import Tenant, enqueue, new_tenant, post_beside
from tests.support.journal import wait_status

NO_TICK = {"tick_s": 3600.0}  # a loop claims only when woken


class Process:
    """One daemon's claiming parts; each turn runs until the test lets it end."""

    def __init__(self, name: str, pool: asyncpg.Pool, dsn: str, max_runs: int) -> None:
        self.name = f"vm:{name}"
        self.pool = pool
        self.hub = Hub(dsn)
        self.metrics = Metrics()
        settings = Settings(max_runs=max_runs, **NO_TICK)
        self.load = LoadMonitor(pool, self.metrics,
                                max_loop_lag_s=settings.max_loop_lag_ms / 1000,
                                max_pool_wait_s=settings.max_pool_wait_ms / 1000)
        self.wakes_owed = 0
        self.notifier = Notifier(pool, local=self.hub, claim_loop=lambda: self)
        self.dispatcher = Dispatcher(pool, self.hub, settings, self.name, self._run_turn,
                                     self.load, self.metrics, hint=self.notifier.notify)
        self._ends: dict[UUID, asyncio.Event] = {}

    def claims(self) -> bool:
        return self.dispatcher.claims()

    def owe_wake(self, committed_by: float, wakes: int) -> None:
        """The dispatcher's, counted."""
        self.wakes_owed += wakes
        self.dispatcher.owe_wake(committed_by, wakes)

    async def _run_turn(self, claim: Claim) -> bool:
        await self._end(claim.run_id).wait()
        await finish_run(self.pool, claim, RunStatus.COMPLETED, seq=None,
                         hint=self.notifier.notify)
        return True

    def _end(self, run_id: UUID) -> asyncio.Event:
        return self._ends.setdefault(run_id, asyncio.Event())

    async def end(self, run_id: UUID) -> None:
        """Let the turn end, and return once its task is over (its slot given back)."""
        [task] = [t for t in self.dispatcher.in_flight if t.get_name() == f"run-{run_id}"]
        self._end(run_id).set()
        await task

    async def post(self, tenant: Tenant, content: str) -> EnqueuedRun:
        """A post with a free slot of this process, started beside its enqueue."""
        slot = await self.dispatcher.reserve()
        assert slot is not None, f"{self.name} has a free slot"
        run, claims = await post_beside(self.pool, tenant.account_id, tenant.conversation_id,
                                        content, slot.terms.worker_id, slot.terms.lease_ttl_s)
        slot.settle(claims)
        assert [c.run_id for c in claims] == [run.run_id], f"{content} started beside its post"
        return run


    async def start(self) -> None:
        await self.hub.start()
        self.notifier.start()
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
    """The claim loops' claim statements: counted, in flight, made to fail while `fail` is
    set, and held before answering while `stall` (an asyncio.Event) is unset."""
    state: dict[str, Any] = {"calls": 0, "in_flight": 0, "fail": False, "stall": None}
    real = dispatcher_module.claim_runs

    async def claim_runs(db: Any, **kwargs: Any) -> list[Claim]:
        state["calls"] += 1
        state["in_flight"] += 1
        try:
            if state["stall"] is not None:
                await state["stall"].wait()
            if state["fail"]:
                raise OSError("the database went away")
            return await real(db, **kwargs)
        finally:
            state["in_flight"] -= 1

    monkeypatch.setattr(dispatcher_module, "claim_runs", claim_runs)
    yield state


class HeldWakes:
    """Holds the notifier's statement for an ending's wake once it has run (the wake decided,
    sent or not), until released: what the loop does meanwhile comes before the wake."""

    def __init__(self) -> None:
        self.armed = False
        self.decided = asyncio.Event()
        self.release = asyncio.Event()

    async def wait_decided(self) -> None:
        await asyncio.wait_for(self.decided.wait(), DEFAULT_TIMEOUT_S)


@pytest.fixture
def held_wakes(monkeypatch: pytest.MonkeyPatch) -> HeldWakes:
    held = HeldWakes()
    real = notifier_module.notify_batch

    async def notify_batch(db: Any, hints: Any, **kwargs: Any) -> Any:
        sent = await real(db, hints, **kwargs)
        if held.armed and any(channel is Channel.RUN_ENQUEUED for channel, _ in hints):
            held.decided.set()
            await held.release.wait()
        return sent

    monkeypatch.setattr(notifier_module, "notify_batch", notify_batch)
    return held


async def _started_by(pool: asyncpg.Pool, run_id: UUID) -> str:
    """The worker that started the run (no loop ticks: only a wake can start it)."""
    row = await wait_status(pool, run_id, RunStatus.RUNNING, timeout=DEFAULT_TIMEOUT_S)
    assert row["worker_id"] is not None
    return str(row["worker_id"])


async def _heard_after(fleet: Listener, what: str) -> str:
    """The next wake the fleet hears (anything heard before is dropped)."""
    try:
        return await fleet.next(DEFAULT_TIMEOUT_S)
    except TimeoutError:
        raise AssertionError(f"no claim loop of the fleet was woken {what}") from None


async def _claims_answered(claims_made: dict[str, Any], calls: int) -> None:
    """Until the claim loops have sent `calls` claims in all and none is in flight."""
    await poll_until(lambda: claims_made["calls"] >= calls
                                   and not claims_made["in_flight"],
                     DEFAULT_TIMEOUT_S, interval=0.002, what=f"{calls} claims answered")


async def _parked_on(process: Process, what: str) -> None:
    async def parked() -> bool:
        return process.dispatcher.waiting_for == what

    await poll_until(parked, DEFAULT_TIMEOUT_S, interval=0.002, what=f"the loop parked: {what}")


def _wake_loop_of(process: Process) -> None:
    """Wake the process's claim loop by a hint heard there alone (as its other news is)."""
    process.hub.hint_locally(Channel.RUN_ENQUEUED, "other news", echo=False)


def _overload(process: Process, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on the process's load monitor says it is overloaded."""
    monkeypatch.setattr(process.load, "overload", lambda: "overloaded (test)")


@dataclass
class Scene:
    """P1 runs T1; Q waits behind it in its conversation; P2 (when asked for) is idle with
    four free slots; every claim loop has answered every wake so far."""

    p1: Process
    p2: Process | None
    t1: EnqueuedRun
    q: EnqueuedRun
    others: list[Tenant]  # accounts that never ran a turn: the fair claim serves them first


@contextlib.asynccontextmanager
async def q_behind_t1(pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any],
                      held_wakes: HeldWakes | None = None, *, with_p2: bool = False,
                      p1_slots: int = 2) -> AsyncIterator[Scene]:
    p1 = Process("p1", pool, dsn, max_runs=p1_slots)
    p2 = Process("p2", pool, dsn, max_runs=4) if with_p2 else None
    processes = [p for p in (p1, p2) if p is not None]
    tenant, *others = [await new_tenant(pool) for _ in range(4)]
    for process in processes:
        await process.start()
    try:
        await _claims_answered(claims_made, len(processes))  # each loop's first: nothing
        t1 = await p1.post(tenant, "t1")
        q = await enqueue(pool, tenant.account_id, tenant.conversation_id, "q")
        # Each loop, woken by q's enqueue, claims once, finds nothing and holds no slot.
        await _claims_answered(claims_made, 2 * len(processes))
        yield Scene(p1, p2, t1, q, others)
    finally:
        claims_made["fail"] = False
        if held_wakes is not None:
            held_wakes.release.set()
        for process in processes:
            await process.close()


async def test_a_post_that_takes_the_slot_an_ending_gave_back_hands_its_wake_on(
        pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any]) -> None:
    """P1 (two slots) runs T1 and X; Q waits behind T1 in its conversation. T1 ends, and a
    post to P1 takes the slot T1 gave back before P1's loop has heard of the ending (the
    post's account is served first, so its claim beside keeps its own turn). P1's loop owes
    the ending's wake and has no slot: it hands the wake on, and P2 starts Q."""
    async with q_behind_t1(pool, dsn, claims_made, with_p2=True) as scene:
        await scene.p1.post(scene.others[0], "x")  # p1 is full
        async with listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
            await scene.p1.end(scene.t1.run_id)
            await scene.p1.post(scene.others[1], "y")  # takes t1's slot
            assert await _heard_after(fleet, "for the turn t1 freed") == "no free slot"
        assert await _started_by(pool, scene.q.run_id) == "vm:p2"


async def test_a_loop_parked_on_a_slot_when_the_wake_comes_hands_it_on(
        pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any],
        held_wakes: HeldWakes) -> None:
    """As above, but other news woke P1's loop before the ending's wake came: it found no
    slot and parked on one. The wake, coming then, is handed on at once."""
    async with q_behind_t1(pool, dsn, claims_made, held_wakes, with_p2=True) as scene:
        p1 = scene.p1
        await p1.post(scene.others[0], "x")  # p1 is full
        async with listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
            held_wakes.armed = True
            await p1.end(scene.t1.run_id)
            await p1.post(scene.others[1], "y")  # takes t1's slot
            await held_wakes.wait_decided()  # the wake is p1's alone; not there yet
            _wake_loop_of(p1)
            await _parked_on(p1, "no free slot")
            held_wakes.release.set()
            assert await _heard_after(fleet, "for the turn t1 freed") == "no free slot"
        assert await _started_by(pool, scene.q.run_id) == "vm:p2"


@pytest.mark.parametrize("parked", [False, True], ids=["then-claims", "parked-on-load"])
async def test_overload_after_the_wake_was_decided_hands_it_on(
        pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any], held_wakes: HeldWakes,
        monkeypatch: pytest.MonkeyPatch, parked: bool) -> None:
    """P1 has a free slot when T1 ends, and the notifier sends the wake to P1's loop alone;
    overload begins before it arrives. Whether the loop then comes to claim, or had come and
    parked on the load already, it hands the wake on, and P2 starts Q."""
    async with q_behind_t1(pool, dsn, claims_made, held_wakes, with_p2=True) as scene:
        p1 = scene.p1
        async with listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
            held_wakes.armed = True
            await p1.end(scene.t1.run_id)
            await held_wakes.wait_decided()
            _overload(p1, monkeypatch)
            if parked:
                _wake_loop_of(p1)
                await _parked_on(p1, "overloaded")
            held_wakes.release.set()
            assert await _heard_after(fleet, "for the turn t1 freed") == "overloaded"
        assert await _started_by(pool, scene.q.run_id) == "vm:p2"


async def test_a_failed_claim_hands_its_owed_wake_on(
        pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any]) -> None:
    """P1's claim after T1's ending fails (the database answered with an error): its loop
    waits a tick, and the fleet is told instead."""
    async with q_behind_t1(pool, dsn, claims_made) as scene, \
            listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
        claims_made["fail"] = True
        await scene.p1.end(scene.t1.run_id)
        assert await _heard_after(fleet, "for the turn t1 freed") == "claim failed"


async def test_a_claim_in_flight_that_fails_hands_on_the_wake_it_acted_for(
        pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any],
        held_wakes: HeldWakes) -> None:
    """Other news woke P1's loop after T1's ending committed: its claim, sent then, acts for
    the ending's wake that arrives while it is in flight; the claim fails, and the wake is
    handed on."""
    async with q_behind_t1(pool, dsn, claims_made, held_wakes) as scene, \
            listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
        p1 = scene.p1
        held_wakes.armed = True
        claims_made["stall"] = stall = asyncio.Event()
        claims_made["fail"] = True
        await p1.end(scene.t1.run_id)
        await held_wakes.wait_decided()
        _wake_loop_of(p1)
        await poll_until(lambda: claims_made["in_flight"] == 1, DEFAULT_TIMEOUT_S,
                         interval=0.002, what="p1's claim in flight")
        held_wakes.release.set()  # the wake arrives while the claim is out
        await poll_until(lambda: p1.wakes_owed == 1, DEFAULT_TIMEOUT_S,
                         interval=0.002, what="the wake to have arrived")
        stall.set()
        assert await _heard_after(fleet, "for the turn t1 freed") == "claim failed"


async def test_a_wake_that_comes_after_a_failed_claim_is_still_owed(
        pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any],
        held_wakes: HeldWakes) -> None:
    """A claim sent after T1's ending but failed saw nothing: the ending's wake, arriving after
    it, is owed all the same (the next claim fails too, and hands it on)."""
    async with q_behind_t1(pool, dsn, claims_made, held_wakes) as scene, \
            listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
        p1 = scene.p1
        held_wakes.armed = True
        claims_made["fail"] = True
        await p1.end(scene.t1.run_id)
        await held_wakes.wait_decided()
        calls = claims_made["calls"]
        _wake_loop_of(p1)
        await poll_until(lambda: claims_made["calls"] > calls
                                       and not claims_made["in_flight"],
                         DEFAULT_TIMEOUT_S, interval=0.002, what="p1's claim to fail")
        assert fleet.drain() == [], "a failed claim that owed nothing hands nothing on"
        held_wakes.release.set()
        assert await _heard_after(fleet, "for the turn t1 freed") == "claim failed"


async def test_a_claim_with_one_slot_acts_for_one_of_two_endings(
        pool: asyncpg.Pool, dsn: str, claims_made: dict[str, Any],
        held_wakes: HeldWakes) -> None:
    """P1 (three slots) runs T1 and T2 (two accounts), each with a turn queued behind it.
    Both end; two posts take two of the three slots free then. P1's claim, with the last slot,
    can start one of the two freed turns: the other ending's wake is still owed, and handed
    on, and P2 starts that turn."""
    async with q_behind_t1(pool, dsn, claims_made, held_wakes, with_p2=True,
                           p1_slots=3) as scene:
        p1, (second, poster, other_poster) = scene.p1, scene.others
        t2 = await p1.post(second, "t2")
        calls = claims_made["calls"]
        q2 = await enqueue(pool, second.account_id, second.conversation_id, "q2")
        await _claims_answered(claims_made, calls + 2)  # each loop, woken by q2, found nothing
        async with listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
            held_wakes.armed = True
            await p1.end(scene.t1.run_id)
            await p1.end(t2.run_id)
            await p1.post(poster, "y1")
            await p1.post(other_poster, "y2")  # one slot left
            held_wakes.release.set()
            assert await _heard_after(fleet, "for the second freed turn") == "no free slot"
        started_by = {await _started_by(pool, run.run_id) for run in (scene.q, q2)}
        assert started_by == {"vm:p1", "vm:p2"}
