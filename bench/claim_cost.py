"""What one claim costs the server as an account's running turns grow.

A claim reads the account's running turns: their slots (to take free ones under its limit) and
their conversations (a conversation runs one turn at a time). This measures one claim's
statement, alone on an idle server, with N turns of the account already running (each in its
own conversation, leases live), for each N of `--running`:

- `one`: a turn is enqueued in a conversation of its own, then claimed (`claim_runs`, limit 1)
  and ended, over and over, so N stays N;
- `locked`: a rival connection holds `--locked` queued turns of the account claimed but not yet
  committed (as a rival daemon's claim does for a moment), and the claim (limit 25) finds
  nothing it may take: the claim every other claim loop runs when one enqueue wakes them all.

Then, for each count B of `--blocked`: B accounts each with a turn running and a follow-up
queued behind it in the same conversation (what a chat's second message does while the answer
streams), beside `--other-running` turns running in an account with nothing queued, and a claim
(limit 10) that finds nothing, as each claim loop's wake does then.

Then, for each count Q of `--backlog`: one account at its running limit (`--backlog-running`
turns running, each in its own conversation) with Q follow-ups queued behind them, beside a
second account whose follow-up waits too, and a claim (limit 10) that finds nothing: a claim
walks an account's queued turns to find one whose conversation is idle.

Per claim: the statement's round trip on the client's clock, and the CPU time of the server
process that ran it (from /proc: on the embedded server only, as the other benchmarks measure
PostgreSQL's CPU). The statistics are refreshed after each phase's turns are written, as the
daemon's refresher would soon do.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

import asyncpg

from agentd.queue import NewRun, claim_runs, enqueue_runs, finish_run
from agentd.vocabulary import RunStatus
from harness import (
    UNBOUNDED_ACCOUNT,
    backend_cpu_seconds,
    base_parser,
    bench_database,
    emit,
    figure,
    machine_info,
    make_account,
    make_conversations,
    open_pool,
    params_of,
    percentiles,
    progress,
)

REQUEST = {"model": "demo", "params": {}}
LEASE_S = 600.0
MAX_QUEUED = UNBOUNDED_ACCOUNT["account_max_queued"]
MAX_RUNNING = UNBOUNDED_ACCOUNT["account_max_running"]
WARMUP = 20
LOCKED_CLAIM_LIMIT = 25
BLOCKED_CLAIM_LIMIT = 10


async def _timed(conn: asyncpg.Connection, cpu: Callable[[], float | None], limit: int,
                 series: dict[str, list[float]] | None) -> int:
    """One claim on `conn`; its wall and server CPU go into `series` (None: a warm-up claim,
    not kept); returns turns claimed."""
    cpu0 = cpu()
    t0 = time.perf_counter()
    claims = await claim_runs(conn, worker_id="bench", lease_ttl_s=LEASE_S, limit=limit,
                              default_max_running=MAX_RUNNING)
    wall = (time.perf_counter() - t0) * 1000
    cpu1 = cpu()
    if series is not None:
        series["wall"].append(wall)
        if cpu0 is not None and cpu1 is not None:
            series["cpu"].append((cpu1 - cpu0) * 1000)
    for claim in claims:
        await finish_run(conn, claim, RunStatus.COMPLETED, seq=claim.last_seq + 1)
    return len(claims)


async def _enqueue(conn: asyncpg.Connection | asyncpg.Pool, account_id: UUID,
                   conversations: list[UUID], tag: str) -> None:
    await enqueue_runs(conn, account_id=account_id, default_max_queued=MAX_QUEUED,
                       runs=[NewRun(c, tag, REQUEST) for c in conversations])


async def measure(dsn: str, server_pid: int | None, running: int, claims: int,
                  locked: int) -> dict[str, Any]:
    pool = await open_pool(dsn, max_size=2)
    conn = await asyncpg.connect(dsn)
    rival = await asyncpg.connect(dsn)
    try:
        _token, account_id = await make_account(pool)
        # Conversations: the running turns', the claimed ones' (one each: a claim never waits
        # behind its own earlier turn) and the rival's.
        convs = await make_conversations(pool, account_id, running + WARMUP + claims + locked)
        busy, rest = convs[:running], convs[running:]
        fresh, held = rest[:WARMUP + claims], rest[WARMUP + claims:]
        if busy:
            await _enqueue(pool, account_id, busy, "running")
            started = await claim_runs(pool, worker_id="bench-busy", lease_ttl_s=LEASE_S,
                                       limit=running, default_max_running=MAX_RUNNING)
            assert len(started) == running, f"started {len(started)} of {running}"
        await conn.execute("ANALYZE agent_run")
        pid = await conn.fetchval("SELECT pg_backend_pid()")

        def cpu() -> float | None:
            return backend_cpu_seconds(server_pid, pid)

        one: dict[str, list[float]] = {"wall": [], "cpu": []}
        for i, conversation in enumerate(fresh):
            await _enqueue(conn, account_id, [conversation], "one")
            got = await _timed(conn, cpu, 1, one if i >= WARMUP else None)
            assert got == 1, "the claim took nothing"
        met: dict[str, list[float]] = {"wall": [], "cpu": []}
        await _enqueue(conn, account_id, held, "locked")
        await conn.execute("ANALYZE agent_run")
        holding = rival.transaction()
        await holding.start()
        try:
            taken = await claim_runs(rival, worker_id="bench-rival", lease_ttl_s=LEASE_S,
                                     limit=locked, default_max_running=MAX_RUNNING)
            assert len(taken) == locked, f"the rival holds {len(taken)} of {locked}"
            for i in range(WARMUP + claims):
                got = await _timed(conn, cpu, LOCKED_CLAIM_LIMIT,
                                   met if i >= WARMUP else None)
                assert got == 0, "a claim took a turn the rival holds"
        finally:
            await holding.rollback()  # the rival's claim never commits
    finally:
        await rival.close()
        await conn.close()
        await pool.close()
    return {"running": running,
            "one_turn": {"wall_ms": percentiles(one["wall"]),
                         "server_cpu_ms_mean": _mean(one["cpu"])},
            "meeting_locked": {"locked": locked, "wall_ms": percentiles(met["wall"]),
                               "server_cpu_ms_mean": _mean(met["cpu"])}}


async def measure_blocked(dsn: str, server_pid: int | None, accounts: int, others: int,
                          claims: int) -> dict[str, Any]:
    """Claims that find nothing beside `accounts` accounts whose queued turn waits behind its
    conversation's running turn, and `others` turns running in an account with none queued."""
    pool = await open_pool(dsn, max_size=2)
    try:
        if others:
            _token, idle_id = await make_account(pool, account="others", device="others")
            await _enqueue(pool, idle_id, await make_conversations(pool, idle_id, others),
                           "other")
            started = await claim_runs(pool, worker_id="bench-others", lease_ttl_s=LEASE_S,
                                       limit=others, default_max_running=MAX_RUNNING)
            assert len(started) == others, f"started {len(started)} of {others}"
        for n in range(accounts):
            _token, account_id = await make_account(pool, account=f"blocked-{n}",
                                                    device=f"device-{n}")
            [conversation] = await make_conversations(pool, account_id, 1)
            await enqueue_runs(pool, account_id=account_id, default_max_queued=MAX_QUEUED,
                               runs=[NewRun(conversation, tag, REQUEST)
                                     for tag in ("first", "follow-up")])
        started = await claim_runs(pool, worker_id="bench-busy", lease_ttl_s=LEASE_S,
                                   limit=accounts, default_max_running=MAX_RUNNING)
        assert len(started) == accounts, f"started {len(started)} of {accounts}"
        series = await _claims_finding_nothing(pool, server_pid, claims)
    finally:
        await pool.close()
    return {"accounts": accounts, "other_running": others, "wall_ms": percentiles(series["wall"]),
            "server_cpu_ms_mean": _mean(series["cpu"])}


async def measure_backlog(dsn: str, server_pid: int | None, backlog: int, running: int,
                          claims: int) -> dict[str, Any]:
    """Claims that find nothing beside an account at its running limit whose `backlog`
    queued turns all wait behind its `running` turns, and a second account waiting too."""
    pool = await open_pool(dsn, max_size=2)
    try:
        _token, busy_id = await make_account(pool, account="at-limit", device="at-limit")
        await pool.execute("UPDATE account SET max_running = $1 WHERE id = $2", running,
                           busy_id)
        busy = await make_conversations(pool, busy_id, running)
        await _enqueue(pool, busy_id, busy, "running")
        started = await claim_runs(pool, worker_id="bench-busy", lease_ttl_s=LEASE_S,
                                   limit=running, default_max_running=MAX_RUNNING)
        assert len(started) == running, f"started {len(started)} of {running}"
        for first in range(0, backlog, 500):  # round robin over the running conversations
            await _enqueue(pool, busy_id, [busy[n % running] for n in
                                           range(first, min(first + 500, backlog))], "behind")
        _token, other_id = await make_account(pool, account="other", device="other")
        [other] = await make_conversations(pool, other_id, 1)
        await enqueue_runs(pool, account_id=other_id, default_max_queued=MAX_QUEUED,
                           runs=[NewRun(other, tag, REQUEST) for tag in ("first", "follow-up")])
        [_started] = await claim_runs(pool, worker_id="bench-busy", lease_ttl_s=LEASE_S,
                                      limit=1, default_max_running=MAX_RUNNING)
        series = await _claims_finding_nothing(pool, server_pid, claims)
    finally:
        await pool.close()
    return {"backlog": backlog, "running": running, "wall_ms": percentiles(series["wall"]),
            "server_cpu_ms_mean": _mean(series["cpu"])}


async def _claims_finding_nothing(pool: asyncpg.Pool, server_pid: int | None,
                                  claims: int) -> dict[str, list[float]]:
    """`claims` claims (limit 10) after the warm-up, each of which must find nothing; their
    wall and server CPU times. The statistics are refreshed first."""
    async with pool.acquire() as conn:
        await conn.execute("ANALYZE agent_run")
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        series: dict[str, list[float]] = {"wall": [], "cpu": []}
        for i in range(WARMUP + claims):
            got = await _timed(conn, lambda: backend_cpu_seconds(server_pid, pid),
                               BLOCKED_CLAIM_LIMIT, series if i >= WARMUP else None)
            assert got == 0, "a claim started a turn queued behind a running one"
    return series


def _p50_and_cpu(what: str, measured: dict[str, Any]) -> list[dict[str, Any]]:
    """The two headline figures of a measured claim: its round trip p50 and server CPU."""
    return [figure(f"{what}, p50", measured["wall_ms"].get("p50"), "ms"),
            figure(f"{what}, server CPU", measured["server_cpu_ms_mean"], "ms")]


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


async def main() -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--running", default="0,100,1000",
                        help="turns of the account running, comma-separated (0,100,1000)")
    parser.add_argument("--claims", type=int, default=300,
                        help="claims measured per figure (300)")
    parser.add_argument("--locked", type=int, default=50,
                        help="queued turns a rival's open claim holds (50)")
    parser.add_argument("--blocked", default="100,500",
                        help="accounts whose follow-up waits behind their running turn, "
                        "comma-separated (100,500)")
    parser.add_argument("--other-running", type=int, default=1000,
                        help="turns running beside them in an account with nothing queued "
                        "(1000)")
    parser.add_argument("--backlog", default="1000,10000",
                        help="follow-ups queued behind the running turns of an account at "
                        "its limit, comma-separated (1000,10000)")
    parser.add_argument("--backlog-running", type=int, default=20,
                        help="that account's running limit, all of it running (20)")
    args = parser.parse_args()
    try:
        counts = [int(n) for n in args.running.split(",")]
        blocked = [int(n) for n in args.blocked.split(",")] if args.blocked else []
        backlogs = [int(n) for n in args.backlog.split(",")] if args.backlog else []
    except ValueError:
        parser.error("--running, --blocked and --backlog take counts such as 0,100,1000")
    if args.quick:
        counts, args.claims = [min(n, 100) for n in counts[:2]], min(args.claims, 30)
        blocked, args.other_running = [min(n, 50) for n in blocked[:1]], \
            min(args.other_running, 50)
        backlogs = [min(n, 200) for n in backlogs[:1]]
        args.running, args.blocked = ",".join(map(str, counts)), ",".join(map(str, blocked))
        args.backlog = ",".join(map(str, backlogs))
    if any(n < 0 for n in counts) or any(n < 1 for n in blocked) or args.claims < 1 \
            or args.locked < 1 or not 0 <= args.other_running <= MAX_RUNNING \
            or any(n < 1 for n in backlogs) or not 1 <= args.backlog_running <= MAX_RUNNING:
        parser.error("--running must be counts >= 0, --blocked and --backlog counts >= 1, "
                     f"--other-running 0..{MAX_RUNNING}, --backlog-running 1..{MAX_RUNNING}; "
                     "--claims and --locked at least 1")
    if max(counts) + args.locked + 1 > MAX_RUNNING:
        parser.error(f"--running plus --locked must stay under the account's {MAX_RUNNING} "
                     "running turns")
    started = time.monotonic()
    rows = []
    async with bench_database(args, "claim_cost") as database:
        machine = await machine_info(database)
        for n in counts:
            progress(f"{n} turns running: {args.claims} claims of one turn, then "
                     f"{args.claims} meeting {args.locked} locked")
            # A database of its own for each: the rival's turns left queued stay behind.
            fresh = await database.fresh(f"n{n}")
            rows.append(await measure(fresh.dsn, database.server_pid, n, args.claims,
                                      args.locked))
        passed_by = []
        for b in blocked:
            progress(f"{b} accounts waiting behind their running turns, {args.other_running} "
                     f"other turns running: {args.claims} claims")
            fresh = await database.fresh(f"b{b}")
            passed_by.append(await measure_blocked(fresh.dsn, database.server_pid, b,
                                                   args.other_running, args.claims))
        behind = []
        for q in backlogs:
            progress(f"{q} follow-ups behind {args.backlog_running} running turns of an "
                     f"account at its limit: {args.claims} claims")
            fresh = await database.fresh(f"q{q}")
            behind.append(await measure_backlog(fresh.dsn, database.server_pid, q,
                                                args.backlog_running, args.claims))
    summary = []
    for row in rows:
        n = row["running"]
        summary += _p50_and_cpu(f"claim of one turn, {n} running", row["one_turn"])
        summary += _p50_and_cpu(f"claim meeting {args.locked} locked turns, {n} running",
                                row["meeting_locked"])
    for row in passed_by:
        summary += _p50_and_cpu(
            f"claim finding nothing beside {row['accounts']} accounts waiting behind running "
            f"turns ({row['other_running']} more running)", row)
    for row in behind:
        summary += _p50_and_cpu(
            f"claim finding nothing beside {row['backlog']} turns queued behind "
            f"{row['running']} running at the account's limit", row)
    emit({"benchmark": "claim_cost", "params": params_of(args), "machine": machine,
          "results": {"by_running": rows, "beside_blocked_accounts": passed_by,
                      "beside_a_backlog_at_the_limit": behind},
          "summary": summary,
          "seconds": round(time.monotonic() - started, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
