"""Fair and bounded, in the database: per-account running and queued limits that no race can
overshoot, the per-account counts that decide them, and the round-robin claim.

Races run on independent connections released together (a barrier), many times over.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from uuid import UUID

import asyncpg
import pytest

from agentd.accounts import (
    LimitChange,
    account_limits,
    parse_limit_change,
    set_account_limits,
)
from agentd.queue import (
    Claim,
    QueueFull,
    claim_runs,
    finish_run,
    reap_expired,
    stop_conversation,
)
from agentd.vocabulary import RunStatus
from tests.integration.helpers import connections, race, raise_unexpected, wait_lease_expired
from tests.support.factories import enqueue, new_conversation, new_tenant, post_beside

LEASE_S = 60.0


async def running_of(db: asyncpg.Pool | asyncpg.Connection, account_id: UUID) -> int:
    return await db.fetchval("SELECT count(*) FROM agent_run WHERE account_id = $1"
                             " AND status = 'running'", account_id)


async def assert_counts_shown(db: asyncpg.Pool | asyncpg.Connection, account_id: UUID) -> None:
    """What `agentd account show` reports equals the run rows."""
    [shown] = [a for a in await account_limits(db) if a.id == account_id]
    rows = await db.fetchrow(
        "SELECT count(*) FILTER (WHERE status = 'queued') AS queued,"
        "       count(*) FILTER (WHERE status = 'running') AS running"
        " FROM agent_run WHERE account_id = $1", account_id)
    assert (shown.queued, shown.running) == (rows["queued"], rows["running"])


async def test_daemons_claiming_together_never_exceed_an_accounts_running_limit(
        dsn: str) -> None:
    """Six claimers (as six daemons would) race for one account with max_running 3, some
    batch-claiming, while a worker finishes turns: after every round exactly min(3, eligible)
    of its turns run, never more, and each freed slot is taken again."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    async with connections(dsn, 8) as (setup, finisher, *claimers):
        tenant = await new_tenant(setup)
        name = await setup.fetchval("SELECT name FROM account WHERE id = $1", tenant.account_id)
        await set_account_limits(setup, name, LimitChange(change_running=True, max_running=3))
        convs = [tenant.conversation_id] + [
            await new_conversation(setup, tenant.account_id) for _ in range(11)]
        for conv in convs:
            for _ in range(3):
                await enqueue(setup, tenant.account_id, conv, "limited")
        running: list[Claim] = []
        peak = 0
        for iteration in range(80):
            context = f"seed {seed}, iteration {iteration}"
            ending = [c for c in running if rng.random() < 0.5]
            # Staggered by up to a few milliseconds, so claimers also meet with different
            # snapshots: some start before, some after, another's claim commits.
            actions = [lambda conn=conn, limit=rng.choice((1, 1, 4)), pause=rng.random() * 0.004:
                       _claim_after(conn, pause, limit)
                       for conn in claimers]
            if ending:
                actions.append(lambda claims=ending: _finish_all(finisher, claims))
            results = await race(*actions)
            raise_unexpected(results, context=context)
            running = [c for c in running if c not in ending]
            running += [c for result in results[:len(claimers)] for c in result]
            now = await running_of(setup, tenant.account_id)
            assert now == len(running) <= 3, context
            peak = max(peak, now)
            queued = await setup.fetchval("SELECT count(*) FROM agent_run WHERE account_id = $1"
                                          " AND status = 'queued'", tenant.account_id)
            if queued and len(running) < 3:
                # A slot the round left free (its claimer lost a race) is taken by the next.
                running += await claim_runs(setup, worker_id="catch-up", lease_ttl_s=LEASE_S)
                assert await running_of(setup, tenant.account_id) == len(running) <= 3, context
            await assert_counts_shown(setup, tenant.account_id)
        assert peak == 3, "the race never reached the limit: it proved nothing"


async def _claim_after(conn: asyncpg.Connection, pause_s: float, limit: int) -> list[Claim]:
    await asyncio.sleep(pause_s)
    return await claim_runs(conn, worker_id="racer", lease_ttl_s=LEASE_S, limit=limit)


async def _finish_all(conn: asyncpg.Connection, claims: list[Claim]) -> None:
    for claim in claims:
        await finish_run(conn, claim, RunStatus.COMPLETED, seq=claim.last_seq + 1)


async def test_racing_enqueues_fill_the_queue_exactly_to_its_limit_and_write_nothing_more(
        dsn: str) -> None:
    async with connections(dsn, 13) as (setup, *posters):
        for iteration in range(15):
            tenant = await new_tenant(setup)
            name = await setup.fetchval("SELECT name FROM account WHERE id = $1",
                                        tenant.account_id)
            await set_account_limits(setup, name, LimitChange(change_queued=True,
                                                              max_queued=5))
            convs = [await new_conversation(setup, tenant.account_id) for _ in posters]
            for conv in convs[:3]:
                await enqueue(setup, tenant.account_id, conv, "already queued")
            before = await _row_counts(setup, tenant.account_id)
            results = await race(*(
                lambda conn=conn, conv=conv, account=tenant.account_id: enqueue(
                    conn, account, conv, "racing")
                for conn, conv in zip(posters, convs, strict=True)))
            raise_unexpected(results, QueueFull, context=f"iteration {iteration}")
            admitted = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, QueueFull)]
            assert (len(admitted), len(refused)) == (2, len(posters) - 2), iteration
            assert {r.max_queued for r in refused} == {5}
            runs, messages, events = await _row_counts(setup, tenant.account_id)
            # The refused wrote nothing: exactly two runs more, with their message and journal.
            assert (runs, messages, events) == (before[0] + 2, before[1] + 2, before[2] + 4)
            await assert_counts_shown(setup, tenant.account_id)


async def _row_counts(db: asyncpg.Connection, account_id: UUID) -> tuple[int, int, int]:
    row = await db.fetchrow(
        "SELECT (SELECT count(*) FROM agent_run WHERE account_id = $1) AS runs,"
        "       (SELECT count(*) FROM message m JOIN conversation c ON c.id = m.conversation_id"
        "         WHERE c.account_id = $1) AS messages,"
        "       (SELECT count(*) FROM run_event e JOIN agent_run r ON r.id = e.run_id"
        "         WHERE r.account_id = $1) AS events", account_id)
    return row["runs"], row["messages"], row["events"]


async def test_a_queued_limit_frees_up_as_turns_start_and_an_idempotent_retry_still_answers(
        pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    name = await pool.fetchval("SELECT name FROM account WHERE id = $1", tenant.account_id)
    await set_account_limits(pool, name, LimitChange(change_queued=True, max_queued=1))
    first = await enqueue(pool, tenant.account_id, tenant.conversation_id, "one",
                          idempotency_key="k1")
    with pytest.raises(QueueFull):
        await enqueue(pool, tenant.account_id, tenant.conversation_id, "two")
    # The same POST again is answered with its run, full queue or not.
    again = await enqueue(pool, tenant.account_id, tenant.conversation_id, "one",
                          idempotency_key="k1")
    assert (again.run_id, again.created) == (first.run_id, False)
    [claim] = await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S)
    assert claim.run_id == first.run_id
    second = await enqueue(pool, tenant.account_id, tenant.conversation_id, "two")
    assert second.created


async def test_account_show_counts_every_transition(pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    other = await new_conversation(pool, tenant.account_id)
    for conv in (tenant.conversation_id, tenant.conversation_id, other, other):
        await enqueue(pool, tenant.account_id, conv, "t")
    await assert_counts_shown(pool, tenant.account_id)
    claims = await claim_runs(pool, worker_id="w", lease_ttl_s=0.05, limit=5)
    assert len(claims) == 2
    await assert_counts_shown(pool, tenant.account_id)
    await wait_lease_expired(pool, claims[0].run_id)
    await reap_expired(pool)  # running -> failed
    await assert_counts_shown(pool, tenant.account_id)
    await stop_conversation(pool, account_id=tenant.account_id, conversation_id=other)
    await assert_counts_shown(pool, tenant.account_id)  # queued -> cancelled
    [late] = await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S)
    await pool.execute("DELETE FROM conversation WHERE id = $1", late.conversation_id)
    [limits] = [a for a in await account_limits(pool) if a.id == tenant.account_id]
    assert (limits.queued, limits.running) == (0, 0)


async def test_the_claim_serves_accounts_round_robin_then_fifo_within_each(
        pool: asyncpg.Pool) -> None:
    accounts = [await new_tenant(pool) for _ in range(3)]
    order: dict[UUID, list[UUID]] = {}
    for tenant in accounts:  # every account queues 4 turns, each in its own conversation
        order[tenant.account_id] = []
        for n in range(4):
            conv = await new_conversation(pool, tenant.account_id)
            order[tenant.account_id].append(
                (await enqueue(pool, tenant.account_id, conv, f"turn {n}")).run_id)
    # A big backlog of the first account, queued after all of that.
    busy = accounts[0]
    for _ in range(30):
        conv = await new_conversation(pool, busy.account_id)
        order[busy.account_id].append((await enqueue(pool, busy.account_id, conv, "x")).run_id)
    taken = [(await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S))[0] for _ in range(12)]
    by_account = [c.account_id for c in taken]
    # Round robin: every window of three claims serves each account once.
    for start in range(0, 12, 3):
        assert Counter(by_account[start:start + 3]) == Counter(t.account_id for t in accounts)
    for tenant in accounts:  # FIFO within each account
        mine = [c.run_id for c in taken if c.account_id == tenant.account_id]
        assert mine == order[tenant.account_id][:4]


async def test_a_quiet_account_starts_before_a_busy_backlog(pool: asyncpg.Pool) -> None:
    busy, quiet = await new_tenant(pool), await new_tenant(pool)
    for _ in range(50):
        conv = await new_conversation(pool, busy.account_id)
        await enqueue(pool, busy.account_id, conv, "backlog")
    for _ in range(5):
        await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S)
    late = await enqueue(pool, quiet.account_id, quiet.conversation_id, "me too")
    [next_claim] = await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S)
    assert next_claim.run_id == late.run_id


async def test_lowering_a_limit_never_stops_a_running_turn_and_applies_to_the_next_claim(
        pool: asyncpg.Pool) -> None:
    tenant = await new_tenant(pool)
    name = await pool.fetchval("SELECT name FROM account WHERE id = $1", tenant.account_id)
    for _ in range(4):
        conv = await new_conversation(pool, tenant.account_id)
        await enqueue(pool, tenant.account_id, conv, "t")
    first = await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S, limit=2)
    await set_account_limits(pool, name, LimitChange(change_running=True, max_running=1))
    assert await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S) == []
    assert await running_of(pool, tenant.account_id) == 2  # both go on
    await finish_run(pool, first[0], RunStatus.COMPLETED, seq=first[0].last_seq + 1)
    assert await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S) == []  # 1 running = max
    await finish_run(pool, first[1], RunStatus.COMPLETED, seq=first[1].last_seq + 1)
    assert len(await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S, limit=3)) == 1
    # Back to the fleet's default: the rest may start.
    await set_account_limits(pool, name, LimitChange(change_running=True, max_running=None))
    assert len(await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S, limit=3)) == 1


async def test_beside_many_running_turns_a_claim_takes_free_slots_up_to_the_limit(
        pool: asyncpg.Pool) -> None:
    """With 200 turns of an account running, the free running slots are found as a set
    difference (sql/025) and the busy conversations as a set (sql/026): claims and posts take
    slots no running turn holds, never more than the limit allows, and a queued turn waits
    while its conversation runs one, however old it is."""
    tenant = await new_tenant(pool)
    name = await pool.fetchval("SELECT name FROM account WHERE id = $1", tenant.account_id)
    await set_account_limits(pool, name, LimitChange(change_running=True, max_running=206))
    convs = [await new_conversation(pool, tenant.account_id) for _ in range(208)]
    for conv in convs[:200]:
        await enqueue(pool, tenant.account_id, conv, "busy")
    busy = await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S, limit=200)
    assert len(busy) == 200
    for conv in convs[200:204]:
        await enqueue(pool, tenant.account_id, conv, "more")
    taken = [len(await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S, limit=2))
             for _ in range(2)]
    assert taken == [2, 2]
    # Nothing queued: a post starts its turn in the statement that writes it.
    _run, beside = await post_beside(pool, tenant.account_id, convs[204], "posted", "w",
                                     LEASE_S)
    assert len(beside) == 1, "the post beside 204 running turns did not start its turn"
    # The oldest queued turn is in a conversation that runs one: the claim passes it by.
    [first] = [c for c in busy if c.conversation_id == convs[0]]
    waiting = await enqueue(pool, tenant.account_id, convs[0], "second")
    for conv in convs[205:]:
        await enqueue(pool, tenant.account_id, conv, "over")
    [one] = await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S, limit=5)
    assert one.conversation_id in convs[205:]
    assert await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S, limit=5) == []  # 206
    await finish_run(pool, first, RunStatus.COMPLETED, seq=first.last_seq + 1)
    [next_claim] = await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S, limit=5)
    assert next_claim.run_id == waiting.run_id
    slots = [r["slot"] for r in await pool.fetch(
        "SELECT slot FROM agent_run WHERE account_id = $1 AND status = 'running'",
        tenant.account_id)]
    assert len(slots) == len(set(slots)) == 206
    assert min(slots) >= 1 and max(slots) <= 206
    await assert_counts_shown(pool, tenant.account_id)


async def test_a_claim_passes_by_accounts_whose_turns_wait_behind_running_ones(
        pool: asyncpg.Pool) -> None:
    """Thirty accounts each have a follow-up queued behind its conversation's running turn; a
    thirty-first has a turn that can start. The claim starts that one, and passes the thirty
    by without taking their running slots (sql/026): the only advisory locks it holds are the
    served account's slot and its round-robin clock, where the claim before took a slot of
    every account it walked."""
    blocked = [await new_tenant(pool) for _ in range(30)]
    for tenant in blocked:
        await enqueue(pool, tenant.account_id, tenant.conversation_id, "first")
        await enqueue(pool, tenant.account_id, tenant.conversation_id, "follow-up")
    running = await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S, limit=100)
    assert len(running) == 30  # every first turn; every follow-up waits behind its own
    # Served last, so round robin walks the thirty before it.
    free = await new_tenant(pool)
    await enqueue(pool, free.account_id, free.conversation_id, "earlier")
    [earlier] = await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S)
    await finish_run(pool, earlier, RunStatus.COMPLETED, seq=earlier.last_seq + 1)
    ready = await enqueue(pool, free.account_id, free.conversation_id, "can start")
    async with pool.acquire() as conn, conn.transaction():
        [claim] = await claim_runs(conn, worker_id="w", lease_ttl_s=LEASE_S, limit=1)
        held = await conn.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                   " AND pid = pg_backend_pid()")
    assert claim.run_id == ready.run_id
    assert held <= 2, f"the claim took {held} advisory locks walking blocked accounts"
    assert await claim_runs(pool, worker_id="w", lease_ttl_s=LEASE_S, limit=5) == []


def test_limit_options_are_checked_and_name_the_bad_one() -> None:
    providers = {"demo", "openai", "local"}
    change = parse_limit_change(max_running="4", max_queued="default",
                                models="openai:*, local:*,demo", providers=providers)
    assert change == LimitChange(change_running=True, max_running=4, change_queued=True,
                                 max_queued=None, change_models=True,
                                 models=("openai:*", "local:*", "demo"))
    assert parse_limit_change(max_running=None, max_queued=None, models="all",
                              providers=providers).models is None
    for options, named in (({"max_running": "-1"}, "--max-running"),
                           ({"max_running": "10001"}, "--max-running"),
                           ({"max_running": "lots"}, "--max-running"),
                           ({"max_queued": "1e9"}, "--max-queued"),
                           ({"max_queued": "2000000"}, "--max-queued"),
                           ({"models": "openai:*,,demo"}, "--models"),
                           ({"models": "nope:*"}, "'nope'"),
                           ({"models": "openai:gpt 4"}, "--models")):
        with pytest.raises(ValueError, match=named):
            parse_limit_change(**{"max_running": None, "max_queued": None, "models": None,
                                  **options}, providers=providers)


async def test_an_enqueue_far_from_a_large_limit_does_not_list_the_free_slots(
        pool: asyncpg.Pool) -> None:
    """Listing an account's free queue slots takes time in proportion to max_queued (up to
    1,000,000), so an enqueue tries slots at random and lists them only when the queue is nearly
    full. Seen through temp files: with a tiny work_mem, sorting a million slot numbers spills to
    disk, while an enqueue that lists nothing writes none."""
    tenant = await new_tenant(pool)
    await pool.execute("UPDATE account SET max_queued = 1000000 WHERE id = $1",
                       tenant.account_id)
    async with pool.acquire() as conn:
        await conn.execute("SET work_mem = '64kB'")
        try:
            before = await _temp_files(conn)
            for n in range(20):
                await enqueue(conn, tenant.account_id, tenant.conversation_id, f"turn {n}")
            assert await _temp_files(conn) == before
            # The listing itself, as a queue near full runs it, does spill: the probe works.
            await conn.fetchval("SELECT count(*) FROM (SELECT g FROM generate_series(1, 1000000)"
                                " g ORDER BY g DESC) s")
            assert await _temp_files(conn) > before
        finally:
            await conn.execute("RESET work_mem")


async def _temp_files(conn: asyncpg.Connection) -> int:
    """This database's temp files so far, this session's included (flushed now, not later)."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    return int(await conn.fetchval(
        "SELECT temp_files FROM pg_stat_database WHERE datname = current_database()"))
