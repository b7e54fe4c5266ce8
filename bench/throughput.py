"""Throughput: zero-delay demo runs over many conversations, with 1 and with 2 daemons.

The daemons start idle on a fresh database; the whole backlog is then enqueued in ONE
transaction with agentd's own enqueue statement (the one POST /runs runs), so its commit wakes
every daemon at once and the HTTP client's cost stays out of the figure. Runs/s = completed runs
divided by the span from the first claim to the last finish (database clock). Also: claim →
finish per run, journal rows per run, each daemon's share and the CPU it and PostgreSQL burned.

With --pgbouncer the daemons' pool goes through a real PgBouncer (the distribution's program,
started in the work directory) in transaction mode: `pooler = transaction`, the LISTEN
connection, migrations and heartbeats on the direct DSN, as a fleet behind PgBouncer runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentd.queue import enqueue_run
from harness import (
    UNBOUNDED_ACCOUNT,
    BenchDatabase,
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
    transactions,
    tree_cpu_seconds,
    wal_fsyncs,
)


@contextlib.contextmanager
def pool_through_pgbouncer(database: BenchDatabase) -> Iterator[tuple[str, dict[str, Any]]]:
    """A PgBouncer in transaction mode in front of the database: (the pool's DSN through it,
    the daemon settings that go with it). The launcher is the tests' own."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.support.pgbouncer import Bouncer

    bouncer = Bouncer(database.dsn, database.workdir / "pgbouncer").start()
    try:
        yield bouncer.dsn(), {"pooler": "transaction", "hub_dsn": database.dsn}
    finally:
        bouncer.close()


async def measure(database: BenchDatabase, count: int, runs: int, conversations: int,
                  tokens: int, delay_ms: int, settings: dict[str, Any], *,
                  pgbouncer: bool = False) -> dict[str, Any]:
    if pgbouncer:
        with pool_through_pgbouncer(database) as (dsn, pooled):
            result = await _measure(database, count, runs, conversations, tokens, delay_ms,
                                    {**settings, **pooled}, dsn=dsn)
        return {**result, "pool": "pgbouncer (transaction mode)"}
    return await _measure(database, count, runs, conversations, tokens, delay_ms, settings)


async def _measure(database: BenchDatabase, count: int, runs: int, conversations: int,
                   tokens: int, delay_ms: int, settings: dict[str, Any], *,
                   dsn: str | None = None) -> dict[str, Any]:
    pool = await open_pool(database.dsn)
    try:
        _token, account_id = await make_account(pool)
        convs = await make_conversations(pool, account_id, conversations, "throughput")
        fsyncs_before = await wal_fsyncs(database.dsn) if database.server_pid else None
        xacts_before = await transactions(database.dsn)
        async with daemons(database, count, dsn=dsn, **settings) as started:
            await asyncio.sleep(1.0)  # start-up work done; every daemon idles on the hub
            cpu_before = [d.cpu_seconds() for d in started]
            pg_before = tree_cpu_seconds(database.server_pid) if database.server_pid else None
            progress(f"{count} daemon(s): enqueueing {runs} runs over {conversations} "
                     "conversations in one transaction")
            params = {"tokens": tokens, "delay_ms": delay_ms}
            async with pool.acquire() as conn, conn.transaction():
                for i in range(runs):
                    content = f"throughput {i}"
                    await enqueue_run(conn, account_id=account_id,
                                      conversation_id=convs[i % conversations], content=content,
                                      request={"content": content, "model": "demo",
                                               "params": params},
                                      default_max_queued=UNBOUNDED_ACCOUNT["account_max_queued"])
            committed = time.monotonic()
            while True:
                left = await pool.fetchval(
                    "SELECT count(*) FROM agent_run WHERE status IN ('queued', 'running')")
                if left == 0:
                    break
                await asyncio.sleep(0.05)
            wall = time.monotonic() - committed
            cpu = [d.cpu_seconds() - b for d, b in zip(started, cpu_before, strict=True)]
            pg_cpu = (tree_cpu_seconds(database.server_pid) - pg_before
                      if pg_before is not None else None)
            workers = {d.name: d for d in started}
            progress(f"{count} daemon(s): done in {wall:.1f} s")
        fsyncs = (await wal_fsyncs(database.dsn) - fsyncs_before
                  if fsyncs_before is not None else None)
        xacts = await transactions(database.dsn) - xacts_before
        span = await pool.fetchrow(
            """SELECT extract(epoch FROM max(finished_at) - min(started_at)) AS seconds,
                      extract(epoch FROM max(started_at) - min(started_at)) AS claim_span,
                      count(*) FILTER (WHERE status = 'completed') AS completed,
                      count(*) AS total
               FROM agent_run""")
        per_run = await pool.fetch(
            "SELECT extract(epoch FROM finished_at - started_at) * 1000 AS ms FROM agent_run")
        by_worker = await pool.fetch(
            "SELECT worker_id, count(*) AS runs FROM agent_run GROUP BY worker_id")
        rows = await pool.fetch(
            "SELECT type, count(*) AS n FROM run_event GROUP BY type ORDER BY type")
    finally:
        await pool.close()
    total_rows = sum(r["n"] for r in rows)
    seconds = float(span["seconds"])
    return {
        "daemons": count,
        "daemon_names": list(workers),
        "runs": span["total"], "completed": span["completed"],
        "span_s": round(seconds, 3),
        "runs_per_s": round(span["completed"] / seconds, 1),
        "wall_s_commit_to_last_terminal": round(wall, 3),
        "first_to_last_claim_s": round(float(span["claim_span"]), 3),
        "claim_to_finish_ms": percentiles(float(r["ms"]) for r in per_run),
        "journal_rows_per_run": round(total_rows / span["total"], 2),
        "journal_rows_by_type": {r["type"]: r["n"] for r in rows},
        "runs_by_worker": sorted(r["runs"] for r in by_worker),
        "daemon_cpu_s": [round(c, 2) for c in cpu],
        "postgres_cpu_s": round(pg_cpu, 2) if pg_cpu is not None else None,
        # Contention-proof costs: CPU per run (all daemons) and disk flushes per run.
        "daemon_cpu_ms_per_run": round(sum(cpu) * 1000 / span["total"], 2),
        "postgres_cpu_ms_per_run": (round(pg_cpu * 1000 / span["total"], 2)
                                    if pg_cpu is not None else None),
        "wal_fsyncs_per_run": round(fsyncs / span["total"], 2) if fsyncs is not None else None,
        "transactions_per_run": round(xacts / span["total"], 2),
    }


async def main() -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=5)
    parser.add_argument("--delay-ms", type=int, default=0)
    parser.add_argument("--daemons", default="1,2", help="daemon counts to measure (1,2)")
    parser.add_argument("--pgbouncer", action="store_true",
                        help="the daemons' pool through a real PgBouncer in transaction mode")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.conversations = min(args.runs, 300), min(args.conversations, 60)
    started = time.monotonic()
    results = []
    async with bench_database(args, "throughput") as first:
        machine = await machine_info(first)
        for i, count in enumerate(int(x) for x in args.daemons.split(",")):
            database = first if i == 0 else await first.fresh(f"d{count}")
            results.append(await measure(database, count, args.runs, args.conversations,
                                         args.tokens, args.delay_ms, daemon_settings(args),
                                         pgbouncer=args.pgbouncer))
    summary = []
    for r in results:
        label = f"{r['daemons']} daemon{'s' if r['daemons'] > 1 else ''}"
        if args.pgbouncer:
            label += ", pool through PgBouncer"
        summary += [
            figure(f"runs/s, {label}", r["runs_per_s"], "runs/s"),
            figure(f"claim → finish p50, {label}", r["claim_to_finish_ms"]["p50"], "ms"),
            figure(f"journal rows per run, {label}", r["journal_rows_per_run"], "rows"),
            figure(f"daemon + PostgreSQL CPU per run, {label}",
                   r["daemon_cpu_ms_per_run"] + (r["postgres_cpu_ms_per_run"] or 0), "ms"),
            figure(f"WAL fsyncs per run, {label}", r["wal_fsyncs_per_run"], ""),
        ]
    emit({"benchmark": "throughput", "params": params_of(args), "machine": machine,
          "results": results, "summary": summary,
          "seconds": round(time.monotonic() - started, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
