"""The floor under the wake figure: the enqueue and the claim as bare statements, no daemon.

One client sends, for each turn, the statements a daemon sends: the enqueue (`enqueue_runs`)
and the claim (`claim_runs`), then ends the turn (`finish_runs`). Turns are spaced by the wake
benchmark's random gaps (20-250 ms by default), so the processes are idle when each turn comes,
as they are in bench/wake_latency.py. Two ways, alternated turn by turn:

- `separate`: the enqueue commits on its own, then the claim is sent (the claim loop's path,
  without the daemon's wake in between);
- `beside`: the post's one statement with a free slot (`post_turn` with a claim: the turn is
  written running, or claimed beside its enqueue, in the commit that wrote it), the path a
  daemon with a free slot takes (docs/architecture.md, "Claim beside the enqueue").

The figure is the database clock from the run row's `created_at` to its `run_started` event. A
round trip of `SELECT 1` is timed the same way, once right after another (hot) and once after
the gap (idle), to show what an idle machine adds to each hop.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from typing import Any

from agentd.queue import ClaimBeside, NewRun, claim_runs, enqueue_run, finish_run, post_turn
from agentd.vocabulary import RunStatus
from harness import (
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

REQUEST = {"model": "demo", "params": {"tokens": 1, "delay_ms": 0}}
WARMUP = 20


async def main() -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=600,
                        help="turns in all, alternating the two ways (default 600)")
    parser.add_argument("--min-gap-ms", type=float, default=20.0)
    parser.add_argument("--max-gap-ms", type=float, default=250.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.quick:
        args.turns = min(args.turns, 60)
    rng = random.Random(args.seed)
    started = time.monotonic()
    figures: dict[str, list[float]] = {"separate": [], "beside": [], "select_hot": [],
                                       "select_idle": []}
    async with bench_database(args, "claim_path") as database:
        machine = await machine_info(database)
        pool = await open_pool(database.dsn, max_size=2)
        try:
            _token, account_id = await make_account(pool)
            [conversation] = await make_conversations(pool, account_id, 1, "claim path")
            progress(f"{args.turns} turns, {args.min_gap_ms:g}-{args.max_gap_ms:g} ms apart")
            for i in range(WARMUP + args.turns):
                await asyncio.sleep(rng.uniform(args.min_gap_ms, args.max_gap_ms) / 1000)
                async with pool.acquire() as conn:
                    t0 = time.perf_counter()
                    await conn.fetchval("SELECT 1")
                    t1 = time.perf_counter()
                    await conn.fetchval("SELECT 1")
                    t2 = time.perf_counter()
                    way = "beside" if i % 2 else "separate"
                    if way == "separate":
                        await enqueue_run(conn, account_id=account_id,
                                          conversation_id=conversation, content="x",
                                          request=REQUEST)
                        [claim] = await claim_runs(conn, worker_id="bench", lease_ttl_s=30)
                    else:
                        _run, beside = await post_turn(
                            conn, account_id=account_id, claim=ClaimBeside("bench", 30),
                            turn=NewRun(conversation, "x", REQUEST))
                        assert beside is not None, "the post did not start its turn"
                        claim = beside
                    run_started = await conn.fetchval(
                        "SELECT created_at FROM run_event WHERE run_id = $1"
                        " AND type = 'run_started'", claim.run_id)
                    await finish_run(conn, claim, RunStatus.COMPLETED,
                                     seq=claim.last_seq + 1, content="ok")
                if i < WARMUP:
                    continue
                assert claim.created_at is not None
                figures[way].append((run_started - claim.created_at).total_seconds() * 1000)
                figures["select_idle"].append((t1 - t0) * 1000)
                figures["select_hot"].append((t2 - t1) * 1000)
                if (i + 1 - WARMUP) % 100 == 0:
                    progress(f"{i + 1 - WARMUP}/{args.turns}")
        finally:
            await pool.close()
    results: dict[str, Any] = {
        "row_to_run_started_ms": {way: percentiles(figures[way])
                                  for way in ("separate", "beside")},
        "select_1_round_trip_ms": {"hot": percentiles(figures["select_hot"]),
                                   "after_the_gap": percentiles(figures["select_idle"])},
    }
    rows = results["row_to_run_started_ms"]
    trips = results["select_1_round_trip_ms"]
    emit({
        "benchmark": "claim_path", "params": params_of(args), "machine": machine,
        "results": results,
        "summary": [
            figure("row → run_started p50, enqueue and claim committed separately",
                   rows["separate"].get("p50"), "ms"),
            figure("row → run_started p50, claim beside the enqueue (one commit)",
                   rows["beside"].get("p50"), "ms"),
            figure("SELECT 1 round trip p50, hot", trips["hot"].get("p50"), "ms"),
            figure("SELECT 1 round trip p50, after the gap", trips["after_the_gap"].get("p50"),
                   "ms"),
        ],
        "seconds": round(time.monotonic() - started, 1),
    })
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
