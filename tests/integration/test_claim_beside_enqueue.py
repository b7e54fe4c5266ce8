"""A claim beside the enqueue, in its own statement (sql/015, sql/019, dispatcher.Reservation): the
turn starts in the commit that wrote it when the fair claim picks it, the transaction keeps no lock
of any other turn's, and the enqueue never fails for the claim.

Real sessions race: enqueuers claiming beside their enqueues, plain claimers and a finisher, each on
its own connection, released together by a barrier, round after round.
"""

from __future__ import annotations

import asyncio
import random
from uuid import UUID

import asyncpg

from agentd.queue import Claim, EnqueuedRun, claim_runs, finish_run, insert_message, open_turn
from agentd.vocabulary import Channel, MessageRole, RunStatus
from tests.integration.helpers import DEFAULT_TIMEOUT_S, connections, race, raise_unexpected
from tests.integration.test_claim_races import assert_no_violations
from tests.support.factories import enqueue, new_conversation, new_tenant, post_beside

LEASE_S = 60.0
ROUNDS = 200
# Enough conversations that a posted turn is often the next in line (a claim beside an enqueue
# takes only that), few enough that enqueuers often meet in one conversation.
CONVERSATIONS = 6


async def _enqueue_and_claim(conn: asyncpg.Connection, account_id: UUID, conversation_id: UUID,
                             content: str, worker: str) -> tuple[UUID, list[Claim], bool]:
    """As service.Service.create_run does it: a deadlock's victim rolled back whole and enqueues
    again without a claim beside it. The third value says whether that happened."""
    try:
        run, claims = await post_beside(conn, account_id, conversation_id, content, worker,
                                        LEASE_S)
        return run.run_id, claims, False
    except asyncpg.DeadlockDetectedError:
        run = await enqueue(conn, account_id, conversation_id, content)
        return run.run_id, [], True


async def test_the_turn_starts_in_the_commit_that_wrote_it(dsn: str) -> None:
    async with connections(dsn, 2) as (conn, other):
        tenant = await new_tenant(conn)
        async with conn.transaction():  # as a retry's post does it: with the claim, in one
            run, [claim] = await post_beside(conn, tenant.account_id, tenant.conversation_id,
                                             "now", "w", LEASE_S)
            assert claim.run_id == run.run_id and run.status == RunStatus.RUNNING
            # Nothing of it is visible before the commit: not queued, not running.
            assert await other.fetchval("SELECT count(*) FROM agent_run") == 0
        row = await other.fetchrow("SELECT status, claim_token, worker_id FROM agent_run "
                                   "WHERE id = $1", run.run_id)
        assert (row["status"], row["claim_token"], row["worker_id"]) == (
            RunStatus.RUNNING, claim.claim_token, "w")
        journal = await other.fetch("SELECT seq, type FROM run_event WHERE run_id = $1 "
                                    "ORDER BY seq", run.run_id)
        assert [(r["seq"], r["type"]) for r in journal] == [
            (1, "user_message"), (2, "run_queued"), (3, "run_started")]
        assert claim.last_seq == 3
        await assert_no_violations(other, "after the commit")


async def _started_rows(db: asyncpg.Connection, run_id: UUID) -> dict[str, object]:
    """What a started turn committed, without the values each turn mints for itself."""
    run = await db.fetchrow(
        "SELECT r.status, r.worker_id, r.slot IS NOT NULL AS has_slot,"
        "       r.claim_token IS NOT NULL AS has_token,"
        "       r.fence IS NOT NULL AS has_fence,"
        "       r.lease_expires_at - r.started_at AS lease, r.last_heartbeat_at = r.started_at"
        "       AS beat_at_start, r.created_at <= r.started_at AS created_first,"
        "       m.status AS question, m.run_id = r.id AS question_of_run,"
        "       l.run_id = r.id AND l.execution_id = r.claim_token AND l.fence = r.fence"
        "       AND l.worker_id = r.worker_id AND l.acquired_at = r.started_at"
        "       AND l.device_id IS NOT DISTINCT FROM r.origin_device_id AS leased,"
        "       a.last_claimed_at = r.started_at AS served"
        " FROM agent_run r JOIN message m ON m.id = r.user_message_id"
        " LEFT JOIN conversation_lease l ON l.conversation_id = r.conversation_id"
        " JOIN account a ON a.id = r.account_id WHERE r.id = $1", run_id)
    journal = await db.fetch(
        "SELECT seq, type, array(SELECT jsonb_object_keys(payload) ORDER BY 1) AS keys,"
        "       payload->>'worker_id' AS worker, (payload->>'fence')::bigint AS fence"
        " FROM run_event WHERE run_id = $1 ORDER BY seq", run_id)
    fence = await db.fetchval("SELECT fence FROM agent_run WHERE id = $1", run_id)
    return {**dict(run), "journal": [
        (r["seq"], r["type"], r["keys"], r["worker"], r["fence"] == fence if r["fence"] else None)
        for r in journal]}


async def test_a_turn_posted_into_an_empty_line_is_written_once_as_the_claim_would_leave_it(
        dsn: str) -> None:
    """Nothing queued, its conversation idle, a running slot free: the fair claim could only pick
    this turn, so the post writes it running at once (sql/021): one insert of the run and one of
    its question, no update of either. What commits is what the enqueue and the claim beside it
    commit when a queued turn elsewhere sends the post down that path (a turn of a conversation
    that runs one already, which the fair claim passes over)."""
    async with connections(dsn, 2) as (conn, other):
        tenant = await new_tenant(conn)
        run, [claim], writes = await _post_counting_writes(
            conn, tenant.account_id, tenant.conversation_id, "straight in")
        assert writes == {"agent_run": (1, 0), "message": (1, 0), "run_event": (3, 0)}
        assert (run.status, claim.run_id, claim.last_seq) == (RunStatus.RUNNING, run.run_id, 3)
        direct = await _started_rows(other, run.run_id)

        # The other path: a queued turn, behind a running one in its own conversation.
        busy = await new_conversation(conn, tenant.account_id)
        _, [_] = await post_beside(conn, tenant.account_id, busy, "running", "w", LEASE_S)
        await enqueue(conn, tenant.account_id, busy, "waits behind it")
        await finish_run(conn, claim, RunStatus.COMPLETED, seq=claim.last_seq + 1, content="ok")
        later, [second], writes = await _post_counting_writes(
            conn, tenant.account_id, tenant.conversation_id, "by the claim")
        assert writes["agent_run"][1] > 0  # the claim rewrote the run the enqueue inserted
        assert second.run_id == later.run_id and later.status == RunStatus.RUNNING
        claimed = await _started_rows(other, later.run_id)
        assert direct == claimed, (direct, claimed)
        assert direct["journal"] == [
            (1, "user_message", ["content", "message_id", "role"], None, None),
            (2, "run_queued", ["conversation_id", "device", "device_id", "run_id"], None, None),
            (3, "run_started", ["fence", "lease_expires_at", "worker_id"], "w", True)]
        await assert_no_violations(other, "after both posts")


# What this transaction has written to each table so far. PostgreSQL's view also holds counts of
# earlier transactions of the session that it has not flushed yet, so callers take differences
# within one transaction.
_WRITES = ("SELECT relname, n_tup_ins, n_tup_upd FROM pg_stat_xact_user_tables"
           " WHERE relname IN ('agent_run', 'message', 'run_event')")


async def _writes(conn: asyncpg.Connection) -> dict[str, tuple[int, int]]:
    return {r["relname"]: (r["n_tup_ins"], r["n_tup_upd"]) for r in await conn.fetch(_WRITES)}


async def _post_counting_writes(conn: asyncpg.Connection, account_id: UUID,
                                conversation_id: UUID, content: str
                                ) -> tuple[EnqueuedRun, list[Claim], dict[str, tuple[int, int]]]:
    """post_beside in a transaction of its own; also the rows it inserted and updated, by
    table: (inserted, updated)."""
    async with conn.transaction():
        before = await _writes(conn)
        run, claims = await post_beside(conn, account_id, conversation_id, content, "w",
                                        LEASE_S)
        after = await _writes(conn)
    return run, claims, {table: (ins - before.get(table, (0, 0))[0],
                                 upd - before.get(table, (0, 0))[1])
                         for table, (ins, upd) in after.items()}


async def test_a_post_into_an_empty_line_never_starts_ahead_of_a_turn_queued_meanwhile(
        dsn: str) -> None:
    """A post with a free slot races a post without one (queued: its process has no slot free)
    into the same idle conversation, on sessions of their own, released together. Whichever
    locks the conversation first is first in its line: the post with the slot may start at once
    only if it came first, and is queued behind the other otherwise. Checking the line before
    taking the conversation's lock would let it start ahead of a turn committed meanwhile."""
    async with connections(dsn, 3) as (setup, with_slot, without):
        tenant = await new_tenant(setup)
        outcomes = {"started first": 0, "queued behind": 0}
        for round_ in range(ROUNDS):
            conv = await new_conversation(setup, tenant.account_id)
            results = await race(
                lambda conv=conv: _post_counting_writes(with_slot, tenant.account_id, conv,
                                                        "slot"),
                lambda conv=conv: enqueue(without, tenant.account_id, conv, "no slot"))
            raise_unexpected(results, context=f"round {round_}")
            (_, claims, writes), _ = results
            rows = await setup.fetch("SELECT r.status, m.content FROM agent_run r"
                                     " JOIN message m ON m.id = r.user_message_id"
                                     " WHERE r.conversation_id = $1 ORDER BY r.created_at", conv)
            order = [(r["content"], r["status"]) for r in rows]
            if claims:
                assert order == [("slot", RunStatus.RUNNING), ("no slot", RunStatus.QUEUED)], \
                    f"round {round_}: {order}"
                assert writes["agent_run"] == (1, 0), f"round {round_}: not as it was written"
                outcomes["started first"] += 1
            else:
                assert order == [("no slot", RunStatus.QUEUED), ("slot", RunStatus.QUEUED)], \
                    f"round {round_}: {order}"
                outcomes["queued behind"] += 1
            await assert_no_violations(setup, f"round {round_}")
            # An empty line again for the next round.
            await setup.execute("DELETE FROM agent_run WHERE conversation_id = $1", conv)
        print(f"a post with a slot against one without: {outcomes}")


async def test_a_turn_started_beside_its_post_carries_what_its_first_read_would_read(
        dsn: str) -> None:
    """The post's claim comes with the transcript (sql/019), and the executor starts without a
    read of its own: it must be exactly what that read (open_turn) finds for the claim, earlier
    turns and their tool steps included, the turn's own question last."""
    calls = [{"id": "call-1", "type": "function",
              "function": {"name": "clock", "arguments": "{}"}}]
    async with connections(dsn, 1) as (conn,):
        tenant = await new_tenant(conn)
        _, [first] = await post_beside(conn, tenant.account_id, tenant.conversation_id,
                                       "first question", "w", LEASE_S)
        await insert_message(conn, first, role=MessageRole.ASSISTANT, content="",
                             tool_calls=calls)
        await insert_message(conn, first, role=MessageRole.TOOL, content="noon",
                             tool_call_id="call-1")
        await finish_run(conn, first, RunStatus.COMPLETED, seq=None, content="first answer")
        _, [second] = await post_beside(conn, tenant.account_id, tenant.conversation_id,
                                        "second question", "w", LEASE_S)
        _, rows = await open_turn(conn, second)
        read = [{key: row[key] for key in ("role", "content", "tool_calls", "tool_call_id")}
                for row in rows]
        assert second.transcript is not None and list(second.transcript) == read
        assert [(m["role"], m["content"], m["tool_calls"]) for m in second.transcript] == [
            ("user", "first question", None), ("assistant", "", calls), ("tool", "noon", None),
            ("assistant", "first answer", None), ("user", "second question", None)]


async def test_a_claim_that_cannot_get_its_locks_leaves_the_enqueue_whole(dsn: str) -> None:
    """The claim waits past lock_timeout on a row another session holds (the account's, which
    the claim moves to the back of the round robin): the claim alone rolls back, the turn is
    enqueued and queued, and the dispatcher's claim takes it later."""
    async with connections(dsn, 2) as (conn, holder):
        tenant = await new_tenant(conn)
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM account WHERE id = $1 FOR NO KEY UPDATE",
                                 tenant.account_id)
            await conn.execute("SET lock_timeout = '200ms'")
            run, claims = await post_beside(conn, tenant.account_id, tenant.conversation_id,
                                            "mine", "w", LEASE_S)
            assert claims == [] and run.status == RunStatus.QUEUED
        assert await conn.fetchval("SELECT status FROM agent_run WHERE id = $1",
                                   run.run_id) == RunStatus.QUEUED
        assert await conn.fetchval("SELECT count(*) FROM run_event WHERE run_id = $1",
                                   run.run_id) == 2
        [later] = await claim_runs(conn, worker_id="w", lease_ttl_s=LEASE_S)
        assert later.run_id == run.run_id
        await assert_no_violations(conn, "after the later claim")


async def test_only_a_turn_left_queued_wakes_the_claim_loops(dsn: str) -> None:
    """A turn started beside its enqueue needs no claim loop, so its post sends no dispatchers'
    wake; one left queued (an older turn is next in line) sends it in the post's commit.
    Notifications arrive in commit order, so a wake for the first post would come first."""
    async with connections(dsn, 2) as (conn, listener):
        heard: asyncio.Queue[str] = asyncio.Queue()
        await listener.add_listener(str(Channel.RUN_ENQUEUED),
                                    lambda *args: heard.put_nowait(args[3]))
        tenant = await new_tenant(conn)
        started, [claim] = await post_beside(conn, tenant.account_id, tenant.conversation_id,
                                             "started", "w", LEASE_S)
        assert claim.run_id == started.run_id
        older, later = [await new_conversation(conn, tenant.account_id) for _ in range(2)]
        await enqueue(conn, tenant.account_id, older, "next in line")
        left, claims = await post_beside(conn, tenant.account_id, later, "left", "w", LEASE_S)
        assert claims == [] and left.status == RunStatus.QUEUED
        assert [await asyncio.wait_for(heard.get(), DEFAULT_TIMEOUT_S) for _ in range(2)] == [
            str(older), str(later)]


async def test_a_claim_beside_takes_only_its_own_turn_and_keeps_no_other_lock(dsn: str) -> None:
    """An older turn of another conversation is next in line: the claim beside takes nothing
    (the claim loop starts both, fairly), and while the enqueue's transaction is still open
    nothing of that other conversation is locked by it (an enqueue into it is not held up)."""
    async with connections(dsn, 2) as (conn, other):
        tenant = await new_tenant(conn)
        first = await enqueue(conn, tenant.account_id, tenant.conversation_id, "first")
        mine = await new_conversation(conn, tenant.account_id)
        async with conn.transaction():
            second, claims = await post_beside(conn, tenant.account_id, mine, "second", "w",
                                               LEASE_S)
            assert claims == []
            async with other.transaction():
                await other.execute("SET LOCAL lock_timeout = '1s'")
                await other.execute("SELECT 1 FROM conversation WHERE id = $1 FOR UPDATE",
                                    tenant.conversation_id)
                await other.execute("SELECT 1 FROM agent_run WHERE id = $1 FOR UPDATE",
                                    first.run_id)
        statuses = dict(await conn.fetch("SELECT id, status FROM agent_run"))
        assert statuses == {first.run_id: RunStatus.QUEUED, second.run_id: RunStatus.QUEUED}
        later = await claim_runs(conn, worker_id="w", lease_ttl_s=LEASE_S, limit=2)
        assert {c.run_id for c in later} == {first.run_id, second.run_id}
        await assert_no_violations(conn, "after the later claim")


async def test_claims_beside_enqueues_race_claimers_and_finishes_without_doubling(
        dsn: str) -> None:
    """Each round, enqueuers post turns (each claiming beside its enqueue), a plain claimer
    claims and a finisher ends running turns, all at once. No run is claimed twice, no enqueue is
    lost, the queue's invariants hold after every round, and everything drains."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    async with connections(dsn, 6) as conns:
        setup, finisher, claimer, enqueuers = conns[0], conns[1], conns[2], conns[3:]
        tenant = await new_tenant(setup)
        convs = [tenant.conversation_id] + [
            await new_conversation(setup, tenant.account_id) for _ in range(CONVERSATIONS - 1)]
        enqueued: set[UUID] = set()
        claimed: dict[UUID, Claim] = {}
        done: set[UUID] = set()
        beside = deadlocks = 0
        for round_ in range(ROUNDS + 1_000):
            draining = round_ >= ROUNDS
            running = [c for c in claimed.values() if c.run_id not in done]
            context = f"seed {seed}, round {round_}"
            actions = []
            if not draining:
                actions = [
                    lambda conn=conn, i=i, conv=rng.choice(convs), text=f"round {round_}": (
                        _enqueue_and_claim(conn, tenant.account_id, conv, text, f"enqueuer-{i}"))
                    for i, conn in enumerate(enqueuers)]
            actions.append(lambda limit=rng.choice((1, 3, 5)): claim_runs(
                claimer, worker_id="claimer", lease_ttl_s=LEASE_S, limit=limit))
            ending = [c for c in running if rng.random() < 0.6]
            if ending:
                actions.append(lambda ending=ending: _finish_all(finisher, ending))
            results = await race(*actions)
            raise_unexpected(results, context=context)
            round_claims: list[Claim] = []
            for result in results[:len(enqueuers) if not draining else 0]:
                run_id, claims, deadlocked = result
                deadlocks += deadlocked
                enqueued.add(run_id)
                beside += len(claims)
                round_claims.extend(claims)
            round_claims.extend(results[0 if draining else len(enqueuers)])
            ids = [c.run_id for c in round_claims]
            assert len(ids) == len(set(ids)), f"{context}: a run claimed twice in one round"
            assert not set(ids) & set(claimed), f"{context}: a run claimed again"
            claimed.update((c.run_id, c) for c in round_claims)
            done.update(c.run_id for c in ending)
            await assert_no_violations(setup, context)
            if draining and not await setup.fetchval(
                    "SELECT count(*) FROM agent_run WHERE status IN ('queued', 'running')"):
                break
        else:
            raise AssertionError(f"seed {seed}: the queue never drained")
        # Every enqueue committed, every turn ran exactly once, and the claims beside the
        # enqueues were exercised (not vacuous).
        assert await setup.fetchval("SELECT count(*) FROM agent_run") == len(enqueued) \
            == ROUNDS * len(enqueuers)
        assert set(claimed) == enqueued
        assert await setup.fetchval(
            "SELECT count(*) FROM agent_run WHERE status <> 'completed'") == 0
        # A turn is claimed beside its enqueue only when it is next in line, which a queue this
        # busy seldom allows (6-13 in 600 were measured): some must have been.
        assert beside > 0, f"seed {seed}: no claim beside an enqueue"
        print(f"claims beside enqueues: {beside}, deadlocks retried: {deadlocks}")


async def _finish_all(conn: asyncpg.Connection, claims: list[Claim]) -> None:
    for claim in claims:
        await finish_run(conn, claim, RunStatus.COMPLETED, seq=claim.last_seq + 1,
                         content="done")
