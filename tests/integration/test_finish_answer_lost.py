"""A turn's terminal write that commits but whose answer is lost on the wire (the connection
drops right after the commit): its retry is refused by the fence, since the run has ended.
The turn is then counted as finished, not as a lost lease, and the ending's wake-ups, which the
lost answer kept from going out, are sent: the conversation's next turn starts at once instead
of at the dispatcher's next tick. A turn's opening read that meets a dropped connection is
read again, not the end of the turn.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import asyncpg
import pytest

from agentd import executor
from agentd.executor import TurnRunner
from agentd.group_commit import Batcher
from agentd.heartbeat import LeaseKeeper
from agentd.hub import Hub
from agentd.metrics import Metrics
from agentd.providers import ProviderRegistry
from agentd.queue import (
    Claim,
    Finish,
    Finishes,
    FinishOutcome,
    WorkerReport,
    claim_runs,
    finish_runs,
    reap_expired,
)
from agentd.settings import load_settings
from agentd.tools import default_tools
from agentd.vocabulary import Channel, RunStatus
from tests.support.factories import enqueue, new_tenant

WORKER = "lost-answer-worker"


@contextlib.asynccontextmanager
async def runner_with(dsn: str, pool: asyncpg.Pool, tmp_path: Path, finishes: Finishes,
                      ) -> AsyncIterator[tuple[TurnRunner, list[tuple[Channel, str]], Metrics]]:
    """A TurnRunner whose terminal writes go through `finishes`: (it, the hints it sent, its
    metrics)."""
    config = tmp_path / "agentd.toml"
    config.write_text("")
    settings = load_settings(config, env={"AGENTD_HEARTBEAT_S": "1", "AGENTD_FLUSH_MS": "20"})
    hints: list[tuple[Channel, str]] = []
    hub = Hub(dsn)
    await hub.start()
    metrics = Metrics()
    keeper = LeaseKeeper(dsn, hub, settings, metrics,
                         report=lambda: WorkerReport(WORKER, "test", 0))
    keeper.start()
    providers = ProviderRegistry(settings)
    try:
        yield (TurnRunner(pool, hub, keeper, settings, providers, default_tools(),
                          hint=lambda channel, payload: hints.append((channel, payload)),
                          metrics=metrics, finishes=finishes), hints, metrics)
    finally:
        await keeper.close()
        await providers.close()
        await hub.close()


async def claimed_turn(pool: asyncpg.Pool) -> Claim:
    tenant = await new_tenant(pool)
    run = await enqueue(pool, tenant.account_id, tenant.conversation_id, "go",
                        request={"content": "go", "model": "demo",
                                 "params": {"tokens": 5, "delay_ms": 0}})
    [claim] = await claim_runs(pool, worker_id=WORKER, lease_ttl_s=30)
    assert claim.run_id == run.run_id
    return claim


# What asyncpg raises when the connection dies between a statement and its answer.
LOST = asyncpg.exceptions.ConnectionDoesNotExistError(
    "connection was closed in the middle of operation")


async def test_a_terminal_write_whose_answer_was_lost_ends_the_turn_and_wakes_its_readers(
        dsn: str, pool: asyncpg.Pool, tmp_path: Path) -> None:
    calls = 0

    async def committed_then_lost(items: Sequence[Finish]) -> list[FinishOutcome]:
        nonlocal calls
        calls += 1
        outcomes = await finish_runs(pool, items)
        if calls == 1:
            raise LOST
        return outcomes

    async with runner_with(dsn, pool, tmp_path, Batcher(pool, committed_then_lost)) as (
            runner, hints, metrics):
        claim = await claimed_turn(pool)
        assert await runner.run(claim), "the turn ended, but the runner says it lost its lease"
    assert calls == 2, "the terminal write was not retried after its lost answer"
    row = await pool.fetchrow("SELECT r.status, m.content FROM agent_run r JOIN message m"
                              " ON m.run_id = r.id AND m.role = 'assistant'"
                              " WHERE r.id = $1", claim.run_id)
    assert row["status"] == RunStatus.COMPLETED and row["content"]
    conversation = str(claim.conversation_id)
    assert (Channel.RUN_ENQUEUED, conversation) in hints, "the next turn was never woken"
    assert (Channel.CONVERSATION, conversation) in hints, "the feeds never heard of the end"
    assert metrics.registry.get_sample_value("agentd_fenced_writes_total") == 0


async def test_a_turn_a_finalizer_ended_while_its_answer_was_lost_has_lost_its_lease(
        dsn: str, pool: asyncpg.Pool, tmp_path: Path) -> None:
    """The same refusal, when the first attempt did NOT commit and the reaper ended the run in
    between: the turn lost its lease, and says so."""
    calls = 0

    async def reaped_then_lost(items: Sequence[Finish]) -> list[FinishOutcome]:
        nonlocal calls
        calls += 1
        if calls == 1:
            [item] = items
            await pool.execute("UPDATE agent_run SET lease_expires_at = clock_timestamp()"
                               " WHERE id = $1", item.claim.run_id)
            assert item.claim.run_id in await reap_expired(pool, grace_s=0, limit=10)
            raise LOST
        return await finish_runs(pool, items)

    async with runner_with(dsn, pool, tmp_path, Batcher(pool, reaped_then_lost)) as (
            runner, hints, metrics):
        claim = await claimed_turn(pool)
        assert not await runner.run(claim), "a turn the reaper ended counted as finished"
    assert calls == 2
    row = await pool.fetchrow("SELECT status, error_code FROM agent_run WHERE id = $1",
                              claim.run_id)
    assert (row["status"], row["error_code"]) == (RunStatus.FAILED, "lease_expired")
    assert metrics.registry.get_sample_value("agentd_fenced_writes_total") == 1
    # Its wake-ups go out all the same: whoever ended the run, it has ended.
    assert (Channel.RUN_ENQUEUED, str(claim.conversation_id)) in hints


async def test_a_turn_whose_opening_read_meets_a_dropped_connection_still_runs(
        dsn: str, pool: asyncpg.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim the dispatcher made reads the lease and transcript first, on a pooled
    connection that may have died with its server (a restart, a failover). That read was not
    retried: the turn failed as an internal error before any work began."""
    real = executor.open_turn
    calls = 0

    async def dropped_once(db: asyncpg.Pool, claim: Claim):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 1:
            raise LOST
        return await real(db, claim)

    monkeypatch.setattr(executor, "open_turn", dropped_once)
    async with runner_with(dsn, pool, tmp_path, Batcher(pool, lambda items: finish_runs(
            pool, items))) as (runner, _hints, _metrics):
        claim = await claimed_turn(pool)
        assert await runner.run(claim)
    assert calls == 2
    assert await pool.fetchval("SELECT status FROM agent_run WHERE id = $1",
                               claim.run_id) == RunStatus.COMPLETED
