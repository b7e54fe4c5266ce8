"""Wake latency: how long an idle daemon takes to pick up a run, claimed beside its enqueue, by
the claim loop woken at once, and poll-only.

Runs are POSTed one at a time, at random intervals, to an idle daemon; each waits until the
previous one finished. Latency = the run's `run_started` journal event minus the run row's
created_at, both stamped by the database clock (clock_timestamp()), so no client clock is
involved. `claim` (started_at - created_at) is the part up to the claim statement itself.

Runs are spaced by a random gap; in poll-only mode the gap also gets a random share of the tick,
so arrivals fall at uniformly random points of the poll cycle (the cycle restarts after each
claim, so a fixed-range gap would correlate with it).

Three modes: `beside`, as shipped (an idle daemon starts the turn in the statement that posts
it, written running at once into an empty line: docs/architecture.md, "Claim beside the
enqueue"; the latency is then the gap between two clock readings of that statement); `notify`, with
claim_on_enqueue off, so the claim loop is woken (by the local hint and the NOTIFY) and claims
after the enqueue has committed, as a daemon does for a turn another daemon took in; and
poll-only, also with claim_on_enqueue off.

Poll-only: the daemon's hub DSN names a database that does not exist, so its single LISTEN
connection never comes up (the hub retries with backoff) and the dispatcher falls back to its
tick, exactly as it does when the hub is down in production (DESIGN rule 6).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from harness import (
    BenchDatabase,
    base_parser,
    bench_database,
    client_session,
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
    post_json,
    progress,
    wait_terminal,
)

TARGET_P50_MS = 2.0
POLL_TICK_S = 0.5


async def measure(database: BenchDatabase, mode: str, runs: int, gap: tuple[float, float],
                  args: argparse.Namespace) -> dict[str, Any]:
    if mode == "beside":
        settings: dict[str, Any] = {"tick_s": 60}
        need_hub = True
    elif mode == "notify":
        settings = {"tick_s": 60, "claim_on_enqueue": False}
        need_hub = True
    else:
        settings = {"tick_s": POLL_TICK_S, "hub_dsn": database.unreachable_dsn(),
                    "claim_on_enqueue": False}
        need_hub = False
        gap = (gap[0], gap[1] + POLL_TICK_S)
    pool = await open_pool(database.dsn)
    try:
        token, account_id = await make_account(pool)
        conversations = await make_conversations(pool, account_id, 10, f"wake {mode}")
        async with daemons(database, 1, need_hub=need_hub,
                           **daemon_settings(args, **settings)) as (daemon,), \
                client_session(token) as http:
            await asyncio.sleep(1.0)  # let start-up work (reconcile, first claims) settle
            progress(f"{mode}: {runs} runs, one at a time, {gap[0] * 1000:.0f}-"
                     f"{gap[1] * 1000:.0f} ms apart")
            run_ids = []
            for i in range(runs):
                await asyncio.sleep(random.uniform(*gap))
                conversation = conversations[i % len(conversations)]
                created = await post_json(
                    http, f"{daemon.url}/v1/conversations/{conversation}/runs",
                    {"content": f"wake {i}", "params": {"tokens": 1, "delay_ms": 0}})
                run_ids.append(created["run_id"])
                await wait_terminal(pool, [created["run_id"]], within_s=30)
                if (i + 1) % 50 == 0:
                    progress(f"{mode}: {i + 1}/{runs}")
            hub_up = None
            async with http.get(f"{daemon.url}/readyz") as resp:
                hub_up = (await resp.json())["hub"]
        rows = await pool.fetch(
            """SELECT r.status,
                      extract(epoch FROM e.created_at - r.created_at) * 1000 AS started_ms,
                      extract(epoch FROM r.started_at - r.created_at) * 1000 AS claim_ms
               FROM agent_run r
               JOIN run_event e ON e.run_id = r.id AND e.type = 'run_started'
               WHERE r.id = ANY($1::uuid[])""", run_ids)
    finally:
        await pool.close()
    return {
        "settings": {k: (v if k != "hub_dsn" else "<a database that does not exist>")
                     for k, v in settings.items()},
        "hub_connected": hub_up,
        "runs": len(rows),
        "completed": sum(1 for r in rows if r["status"] == "completed"),
        "enqueue_to_run_started_ms": percentiles(float(r["started_ms"]) for r in rows),
        "enqueue_to_claim_ms": percentiles(float(r["claim_ms"]) for r in rows),
    }


async def main() -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300,
                        help="runs claimed beside their enqueue (default 300)")
    parser.add_argument("--notify-runs", type=int, default=300,
                        help="runs claimed by the loop, woken at once (default 300; 0 skips it)")
    parser.add_argument("--poll-runs", type=int, default=100,
                        help="runs in poll-only mode (default 100; 0 skips it)")
    parser.add_argument("--min-gap-ms", type=float, default=20.0)
    parser.add_argument("--max-gap-ms", type=float, default=250.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.poll_runs = min(args.runs, 40), min(args.poll_runs, 20)
        args.notify_runs = min(args.notify_runs, 40)
    random.seed(args.seed)
    gap = (args.min_gap_ms / 1000, args.max_gap_ms / 1000)
    started = time.monotonic()
    async with bench_database(args, "wake") as database:
        machine = await machine_info(database)
        beside = await measure(database, "beside", args.runs, gap, args)
        notify: dict[str, Any] = {"enqueue_to_run_started_ms": {"n": 0},
                                  "enqueue_to_claim_ms": {"n": 0}}
        if args.notify_runs:
            notify = await measure(await database.fresh("notify"), "notify", args.notify_runs,
                                   gap, args)
        poll: dict[str, Any] = {"enqueue_to_run_started_ms": {"n": 0}}
        if args.poll_runs:
            poll = await measure(await database.fresh("poll"), "poll", args.poll_runs, gap, args)
    p50 = beside["enqueue_to_run_started_ms"].get("p50")
    result = {
        "benchmark": "wake_latency", "params": params_of(args), "machine": machine,
        "results": {"beside": beside, "notify": notify, "poll_only": poll},
        "summary": [
            figure("enqueue → run_started p50", p50, "ms",
                   target=f"≤ {TARGET_P50_MS:g} ms",
                   met=p50 is not None and p50 <= TARGET_P50_MS),
            figure("enqueue → run_started p99",
                   beside["enqueue_to_run_started_ms"].get("p99"), "ms"),
            figure("enqueue → run_started p50, claim loop woken at once (claim_on_enqueue off)",
                   notify["enqueue_to_run_started_ms"].get("p50"), "ms"),
            figure("enqueue → run_started p99, claim loop woken at once (claim_on_enqueue off)",
                   notify["enqueue_to_run_started_ms"].get("p99"), "ms"),
            figure("enqueue → claim p50, claim loop woken at once (claim_on_enqueue off)",
                   notify["enqueue_to_claim_ms"].get("p50"), "ms"),
            figure("enqueue → run_started p50, poll-only (tick 0.5 s)",
                   poll["enqueue_to_run_started_ms"].get("p50"), "ms"),
            figure("enqueue → run_started p99, poll-only (tick 0.5 s)",
                   poll["enqueue_to_run_started_ms"].get("p99"), "ms"),
        ],
        "seconds": round(time.monotonic() - started, 1),
    }
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
