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
from agentd.dispatcher import Dispatcher
from agentd.hub import Hub
from agentd.load import LoadMonitor
from agentd.metrics import Metrics
from agentd.queue import Claim, finish_run
from agentd.settings import Settings
from agentd.vocabulary import RunStatus
from tests.integration.helpers import DEFAULT_TIMEOUT_S
from tests.support.daemon import poll_until
from tests.support.factories import enqueue, new_tenant
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
    started: list[Claim] = []

    async def run_turn(claim: Claim) -> bool:
        started.append(claim)
        await finish_run(pool, claim, RunStatus.COMPLETED, seq=None)
        return True

    tenant = await new_tenant(pool)
    queued = await enqueue(pool, tenant.account_id, tenant.conversation_id, "in flight")
    dispatcher = _dispatcher(pool, hub, run_turn)
    dispatcher.start()
    await asyncio.wait_for(committed.wait(), DEFAULT_TIMEOUT_S)

    stopping = asyncio.create_task(dispatcher.stop_claiming())

    async def drain_begun() -> bool:
        return dispatcher.draining

    await poll_until(drain_begun, DEFAULT_TIMEOUT_S, interval=0.001,
                     what="the drain to begin while the claim is still out")
    assert not stopping.done(), "the drain waits for the claim in flight"
    go_on.set()
    await asyncio.wait_for(stopping, DEFAULT_TIMEOUT_S)
    assert await dispatcher.drain(DEFAULT_TIMEOUT_S) == (1, 0)

    assert [c.run_id for c in started] == [queued.run_id]
    assert (await run_row(pool, queued.run_id))["status"] == RunStatus.COMPLETED


def _dispatcher(pool: asyncpg.Pool, hub: Hub,
                run_turn: Callable[[Claim], Awaitable[bool]]) -> Dispatcher:
    metrics = Metrics()
    settings = Settings()
    load = LoadMonitor(pool, metrics, max_loop_lag_s=settings.max_loop_lag_ms / 1000,
                       max_pool_wait_s=settings.max_pool_wait_ms / 1000)
    return Dispatcher(pool, hub, settings, "vm:dispatcher-test", run_turn, load, metrics)
