"""The dispatcher's claim loop against a real database: a drain that begins while a claim is in
flight waits for it, and every run that claim committed gets a task (it then finishes or is
ended by the drain), instead of sitting `running` with nobody executing it until its lease
runs out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from agentd import dispatcher as dispatcher_module
from agentd.dispatcher import Dispatcher, Reservation
from agentd.hub import Hub
from agentd.load import LoadMonitor
from agentd.metrics import Metrics
from agentd.queue import Claim, Db, EnqueuedRun, finish_run
from agentd.settings import Settings
from agentd.vocabulary import Channel, RunStatus
from tests.integration.helpers import DEFAULT_TIMEOUT_S, listening
from tests.support.daemon import poll_until
from tests.support.factories import Tenant, enqueue, new_tenant, post_beside
from tests.support.journal import run_row


async def test_a_drain_begun_during_a_claim_runs_what_that_claim_committed(
        pool: asyncpg.Pool, hub: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    committed, go_on = asyncio.Event(), asyncio.Event()
    real_claim = dispatcher_module.claim_runs

    async def claim_then_stall(*args: Any, **kwargs: Any) -> list[Claim]:
        claims = await real_claim(*args, **kwargs)
        if claims:  # committed; the answer has not reached the loop yet
            committed.set()
            await go_on.wait()
        return claims

    monkeypatch.setattr(dispatcher_module, "claim_runs", claim_then_stall)
    in_flight = asyncio.Event()
    started, run_turn = _recording_turns(pool, until=in_flight)
    tenant = await new_tenant(pool)
    queued = await enqueue(pool, tenant.account_id, tenant.conversation_id, "in flight")
    dispatcher = _dispatcher(pool, hub, run_turn)
    dispatcher.start()
    await asyncio.wait_for(committed.wait(), DEFAULT_TIMEOUT_S)

    stopping = asyncio.create_task(dispatcher.stop_claiming())
    await _drain_begun(dispatcher, "while the claim is still out")
    assert not stopping.done(), "the drain waits for the claim in flight"
    go_on.set()
    await asyncio.wait_for(stopping, DEFAULT_TIMEOUT_S)
    in_flight.set()
    assert await dispatcher.drain(DEFAULT_TIMEOUT_S) == (1, 0)

    assert [c.run_id for c in started] == [queued.run_id]
    assert (await run_row(pool, queued.run_id))["status"] == RunStatus.COMPLETED


async def test_a_drain_begun_during_a_claim_beside_an_enqueue_runs_what_it_committed(
        pool: asyncpg.Pool, hub: Hub) -> None:
    in_flight = asyncio.Event()
    started, run_turn = _recording_turns(pool, until=in_flight)
    tenant = await new_tenant(pool)
    dispatcher = _dispatcher(pool, hub, run_turn)
    slot = await dispatcher.reserve()
    assert slot is not None
    async with pool.acquire() as conn:
        async with conn.transaction():  # held open: the post's statement has run, not committed
            queued, claims = await _post(conn, tenant, "beside", slot)
            stopping = asyncio.create_task(dispatcher.stop_claiming())
            await _drain_begun(dispatcher, "while the claim beside is open")
            assert await dispatcher.reserve() is None, "no claim beside once the drain began"
        assert not stopping.done(), "the drain waits for the claim beside to settle"
        slot.settle(claims)
    await asyncio.wait_for(stopping, DEFAULT_TIMEOUT_S)
    in_flight.set()
    assert await dispatcher.drain(DEFAULT_TIMEOUT_S) == (1, 0)
    assert [c.run_id for c in started] == [queued.run_id]
    assert (await run_row(pool, queued.run_id))["status"] == RunStatus.COMPLETED


async def test_slots_for_claims_beside_enqueues_are_free_ones_one_at_a_time(
        pool: asyncpg.Pool, hub: Hub) -> None:
    release = asyncio.Event()

    async def run_turn(claim: Claim) -> bool:
        await release.wait()
        await finish_run(pool, claim, RunStatus.COMPLETED, seq=None)
        return True

    tenant = await new_tenant(pool)
    dispatcher = _dispatcher(pool, hub, run_turn, max_runs=2)
    first = await dispatcher.reserve()
    assert first is not None
    assert await dispatcher.reserve() is None, "one claim beside an enqueue at a time"
    first.settle([])  # nothing committed: the slot comes back
    again = await dispatcher.reserve()
    assert again is not None
    _, claims = await _post(pool, tenant, "one", again)
    again.settle(claims)
    assert len(claims) == 1 and len(dispatcher.in_flight) == 1
    # One slot of two is taken by the running turn: the other can still be reserved...
    last = await dispatcher.reserve()
    assert last is not None
    other = await new_tenant(pool)
    _, claims = await _post(pool, other, "two", last)
    last.settle(claims)
    assert len(dispatcher.in_flight) == 2
    # ...and with both running, none is free.
    assert await dispatcher.reserve() is None
    release.set()
    assert await dispatcher.drain(DEFAULT_TIMEOUT_S) == (2, 0)
    assert await dispatcher.reserve() is not None, "the slots came back with the turns' ends"

    off = _dispatcher(pool, hub, run_turn, claim_on_enqueue=False)
    assert await off.reserve() is None


async def test_a_turn_claimed_beside_its_enqueue_is_announced_by_that_commit_alone(
        pool: asyncpg.Pool, hub: Hub, dsn: str) -> None:
    """The claim beside an enqueue sends no run_event hint for its run_started: that row
    committed with the run and with the conversation's wake, so a feed elsewhere, woken by
    that wake, finds it in its first read (and a run tail opens only after the post answers).
    A hint would cost one more transaction on the way to the first token."""
    started, run_turn = _recording_turns(pool)
    hints: list[tuple[Channel, str]] = []
    tenant = await new_tenant(pool)
    listener = await asyncpg.connect(dsn)  # a feed in another process, as the hub hears it
    heard: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    try:
        for channel in (Channel.CONVERSATION, Channel.RUN_EVENT):
            await listener.add_listener(str(channel),
                                        lambda _c, _p, ch, payload: heard.put_nowait((ch, payload)))
        metrics, settings = Metrics(), Settings()
        load = LoadMonitor(pool, metrics, max_loop_lag_s=settings.max_loop_lag_ms / 1000,
                           max_pool_wait_s=settings.max_pool_wait_ms / 1000)
        dispatcher = Dispatcher(pool, hub, settings, "vm:dispatcher-test", run_turn, load, metrics,
                                hint=lambda channel, payload: hints.append((channel, payload)))
        slot = await dispatcher.reserve()
        assert slot is not None
        queued, claims = await _post(pool, tenant, "now", slot)
        slot.settle(claims)
        assert [c.run_id for c in claims] == [queued.run_id]
        assert (Channel.RUN_EVENT, str(queued.run_id)) not in hints
        # The conversation's wake, then the first read a feed makes: run_started is there.
        assert await asyncio.wait_for(heard.get(), DEFAULT_TIMEOUT_S) == (
            str(Channel.CONVERSATION), str(tenant.conversation_id))
        journal = await listener.fetch("SELECT seq, type FROM run_event WHERE run_id = $1 "
                                       "ORDER BY seq", queued.run_id)
        assert [(r["seq"], r["type"]) for r in journal][:3] == [
            (1, "user_message"), (2, "run_queued"), (3, "run_started")]
        await poll_until(lambda: bool(started), DEFAULT_TIMEOUT_S, interval=0.002,
                         what="the turn to start")
        await dispatcher.drain(DEFAULT_TIMEOUT_S)
    finally:
        await listener.close()


async def test_a_drain_wakes_the_other_claim_loops(pool: asyncpg.Pool, hub: Hub,
                                                   dsn: str) -> None:
    """While a process claims, the wakes of its own endings go to its loop alone (notifier.py);
    once it stops claiming, one NOTIFY tells every other loop to look for what it left."""
    _started, run_turn = _recording_turns(pool)
    dispatcher = _dispatcher(pool, hub, run_turn)
    assert not dispatcher.claims(), "not started"
    dispatcher.start()
    assert dispatcher.claims()
    async with listening(dsn, str(Channel.RUN_ENQUEUED)) as fleet:
        await dispatcher.stop_claiming()
        assert not dispatcher.claims()
        assert await fleet.next() == "drain"
    assert await dispatcher.drain(DEFAULT_TIMEOUT_S) == (0, 0)


def _recording_turns(pool: asyncpg.Pool, until: asyncio.Event | None = None,
                     ) -> tuple[list[Claim], Callable[[Claim], Awaitable[bool]]]:
    """A turn runner that records each claim it is given and ends its run at once, or once
    `until` is set (so a drain begun meanwhile finds the turn in flight)."""
    started: list[Claim] = []

    async def run_turn(claim: Claim) -> bool:
        started.append(claim)
        if until is not None:
            await until.wait()
        await finish_run(pool, claim, RunStatus.COMPLETED, seq=None)
        return True

    return started, run_turn


async def _drain_begun(dispatcher: Dispatcher, when: str) -> None:
    async def begun() -> bool:
        return dispatcher.draining

    await poll_until(begun, DEFAULT_TIMEOUT_S, interval=0.001, what=f"the drain to begin {when}")


async def _post(db: Db, tenant: Tenant, content: str,
                slot: Reservation) -> tuple[EnqueuedRun, list[Claim]]:
    """A turn posted with the slot held, as the service posts it (queue.post_turn)."""
    return await post_beside(db, tenant.account_id, tenant.conversation_id, content,
                             slot.terms.worker_id, slot.terms.lease_ttl_s)


def _dispatcher(pool: asyncpg.Pool, hub: Hub,
                run_turn: Callable[[Claim], Awaitable[bool]], **settings_: Any) -> Dispatcher:
    metrics = Metrics()
    settings = Settings(**settings_)
    load = LoadMonitor(pool, metrics, max_loop_lag_s=settings.max_loop_lag_ms / 1000,
                       max_pool_wait_s=settings.max_pool_wait_ms / 1000)
    return Dispatcher(pool, hub, settings, "vm:dispatcher-test", run_turn, load, metrics)


async def test_a_turn_that_ended_unseen_then_failed_still_wakes_who_waits(
        pool: asyncpg.Pool, hub: Hub) -> None:
    """The turn's own terminal write committed but it never learned so (a lost answer, a
    drain's cancel) and failed: the backstop found the run ended (LeaseLost) and returned, and
    the ending's wakes never went out; the conversation's next turn waited for a poll."""
    hints: list[tuple[Channel, str]] = []

    async def ended_then_failed(claim: Claim) -> bool:
        await finish_run(pool, claim, RunStatus.COMPLETED, seq=None)  # no hint: "lost"
        raise asyncpg.exceptions.ConnectionDoesNotExistError("the answer was lost (test)")

    metrics, settings = Metrics(), Settings()
    load = LoadMonitor(pool, metrics, max_loop_lag_s=settings.max_loop_lag_ms / 1000,
                       max_pool_wait_s=settings.max_pool_wait_ms / 1000)
    dispatcher = Dispatcher(pool, hub, settings, "vm:dispatcher-test", ended_then_failed, load,
                            metrics, hint=lambda channel, payload: hints.append((channel, payload)))
    tenant = await new_tenant(pool)
    queued = await enqueue(pool, tenant.account_id, tenant.conversation_id, "go")
    dispatcher.start()
    try:
        conversation = str(tenant.conversation_id)
        await poll_until(lambda: (Channel.RUN_ENQUEUED, conversation) in hints,
                         DEFAULT_TIMEOUT_S, what="the ending's wake to the claim loops")
        assert (Channel.CONVERSATION, conversation) in hints
        assert (await run_row(pool, queued.run_id))["status"] == RunStatus.COMPLETED
    finally:
        await dispatcher.stop_claiming()
        await dispatcher.drain(DEFAULT_TIMEOUT_S)
