"""Fairness: a busy account's backlog must not hold back a quiet account's turn.

Account A enqueues `--backlog` demo turns (default 2,000; each in its own conversation, ~1 s
each) on `--daemons` daemons of `--max-runs` slots; once they are saturated, account B enqueues
one turn, `--trials` times at random moments. Measured on the database clock: B's wait from
enqueue to start, and how many of A's turns started between B's enqueue and B's start (the fair
claim promises at most one claim cycle: one per daemon). For comparison: how many of A's turns
were queued ahead of B, which a FIFO claim would have run first, and the wait that would cost.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from uuid import UUID

import asyncpg

from agentd.queue import enqueue_run
from harness import (
    UNBOUNDED_ACCOUNT,
    base_parser,
    bench_database,
    daemon_settings,
    daemons,
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


async def started(pool: asyncpg.Pool, run_id: UUID, within_s: float) -> asyncpg.Record:
    deadline = time.monotonic() + within_s
    while True:
        row = await pool.fetchrow("SELECT created_at, started_at FROM agent_run WHERE id = $1",
                                  run_id)
        if row["started_at"] is not None:
            return row
        if time.monotonic() > deadline:
            raise RuntimeError(f"B's turn {run_id} did not start within {within_s:g} s")
        await asyncio.sleep(0.005)


async def saturated(pool: asyncpg.Pool, slots: int) -> None:
    """Return once every slot of the fleet runs one of A's turns."""
    for _ in range(6000):
        if await pool.fetchval("SELECT count(*) FROM agent_run WHERE status = 'running'") \
                >= slots:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"the fleet never ran {slots} turns at once")


async def main() -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--backlog", type=int, default=2000, help="account A's queued turns")
    parser.add_argument("--trials", type=int, default=9, help="account B's turns, one at a time")
    parser.add_argument("--daemons", type=int, default=1)
    parser.add_argument("--max-runs", type=int, default=16, help="slots per daemon")
    parser.add_argument("--tokens", type=int, default=10)
    parser.add_argument("--delay-ms", type=int, default=100)
    args = parser.parse_args()
    if args.quick:
        args.backlog, args.trials = min(args.backlog, 200), min(args.trials, 3)
    started_at = time.monotonic()
    rng = random.Random(12)
    settings = daemon_settings(args, max_runs=args.max_runs)
    params = {"tokens": args.tokens, "delay_ms": args.delay_ms}
    async with bench_database(args, "fairness") as database:
        machine = await machine_info(database)
        pool = await open_pool(database.dsn)
        try:
            _token, busy = await make_account(pool, "busy")
            _token, quiet = await make_account(pool, "quiet")
            backlog = await make_conversations(pool, busy, args.backlog, "backlog")
            trials_conversations = await make_conversations(pool, quiet, args.trials, "quiet")
            async with daemons(database, args.daemons, **settings):
                progress(f"account A enqueues {args.backlog} turns "
                         f"({args.tokens} tokens {args.delay_ms} ms apart)")
                async with pool.acquire() as conn, conn.transaction():
                    for n, conversation in enumerate(backlog):
                        await enqueue_run(conn, account_id=busy, conversation_id=conversation,
                                          content=f"backlog {n}",
                                          request={"content": f"backlog {n}", "params": params},
                                          default_max_queued=UNBOUNDED_ACCOUNT[
                                              "account_max_queued"])
                slots = args.daemons * args.max_runs
                await saturated(pool, slots)
                progress(f"saturated ({slots} slots); account B enqueues one turn at a time")
                trials = []
                for n, conversation in enumerate(trials_conversations):
                    await asyncio.sleep(rng.uniform(0.2, 1.0))
                    content = f"quiet {n}"
                    run = await enqueue_run(pool, account_id=quiet,
                                            conversation_id=conversation, content=content,
                                            request={"content": content, "params": params})
                    row = await started(pool, run.run_id, within_s=120)
                    jumped = await pool.fetchval(
                        "SELECT count(*) FROM agent_run WHERE account_id = $1"
                        " AND started_at > $2 AND started_at < $3",
                        busy, row["created_at"], row["started_at"])
                    ahead = await pool.fetchval(
                        "SELECT count(*) FROM agent_run WHERE account_id = $1"
                        " AND created_at < $2 AND (started_at IS NULL OR started_at > $2)",
                        busy, row["created_at"])
                    trials.append({
                        "wait_ms": (row["started_at"] - row["created_at"]).total_seconds()
                        * 1000, "a_started_in_between": jumped, "a_queued_ahead": ahead})
                    progress(f"trial {n}: B waited {trials[-1]['wait_ms']:.1f} ms; "
                             f"{jumped} of A's turns started meanwhile; {ahead} were ahead")
                # A's pace while saturated: what a FIFO claim would have made B wait.
                window = await pool.fetchrow(
                    "SELECT count(*) AS n, extract(epoch FROM max(started_at) - min(started_at))"
                    " AS s FROM agent_run WHERE account_id = $1 AND started_at IS NOT NULL",
                    busy)
        finally:
            await pool.close()
    a_rate = window["n"] / float(window["s"]) if window["s"] else None
    waits = [t["wait_ms"] for t in trials]
    jumped = [t["a_started_in_between"] for t in trials]
    ahead = [t["a_queued_ahead"] for t in trials]
    fifo_wait_s = statistics.median(ahead) / a_rate if a_rate else None
    emit({
        "benchmark": "fairness", "params": params_of(args), "machine": machine,
        "results": {"trials": trials, "b_wait_ms": percentiles(waits),
                    "a_started_in_between": percentiles(jumped, 0),
                    "a_queued_ahead": percentiles(ahead, 0),
                    "a_turns_started_per_s": round(a_rate, 1) if a_rate else None,
                    "fifo_wait_estimate_s": round(fifo_wait_s, 1) if fifo_wait_s else None},
        "summary": [
            figure(f"B's turn: enqueue → start, median (A's backlog {args.backlog})",
                   statistics.median(waits), "ms"),
            figure("A's turns started between B's enqueue and B's start, median",
                   statistics.median(jumped), "turns", target=f"≤ {args.daemons} (one claim "
                   "cycle)", met=statistics.median(jumped) <= args.daemons),
            figure("A's turns queued ahead of B (a FIFO claim runs them first), median",
                   statistics.median(ahead), "turns"),
            figure("B's wait under FIFO at A's pace (estimate)", fifo_wait_s, "s"),
        ],
        "seconds": round(time.monotonic() - started_at, 1),
    })
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
