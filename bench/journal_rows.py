"""Journal rows for one long streamed answer: how well token deltas are coalesced.

One demo run streams `--tokens` tokens `--delay-ms` apart (default 2,000 at 20 ms: 40 s). The
emitter journals the first delta at once and coalesces the rest on a `flush_ms` clock (250 ms),
so the budget is generation time / 250 ms content_delta rows plus the structural events
(user_message, run_queued, run_started, complete). Generation time is measured on the database
clock, from the `run_started` event to the `complete` event.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time

from harness import (
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

FLUSH_S = 0.250


async def main() -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--delay-ms", type=int, default=20)
    args = parser.parse_args()
    if args.quick and args.tokens == parser.get_default("tokens"):
        args.tokens = 250  # 5 s at 20 ms
    started = time.monotonic()
    nominal_s = args.tokens * args.delay_ms / 1000
    async with bench_database(args, "journal") as database:
        machine = await machine_info(database)
        pool = await open_pool(database.dsn)
        try:
            token, account_id = await make_account(pool)
            (conversation,) = await make_conversations(pool, account_id, 1, "journal")
            async with daemons(database, 1, **daemon_settings(args)) as (daemon,), \
                    client_session(token) as http:
                progress(f"one run: {args.tokens} tokens, {args.delay_ms} ms apart "
                         f"(~{nominal_s:.0f} s)")
                created = await post_json(
                    http, f"{daemon.url}/v1/conversations/{conversation}/runs",
                    {"content": "a long answer, please",
                     "params": {"tokens": args.tokens, "delay_ms": args.delay_ms}})
                status = await wait_terminal(pool, [created["run_id"]],
                                             within_s=nominal_s * 3 + 60, interval=0.2)
            run_id = created["run_id"]
            rows = await pool.fetch(
                "SELECT seq, type, created_at, payload FROM run_event WHERE run_id = $1 "
                "ORDER BY seq", run_id)
        finally:
            await pool.close()
    by_type: dict[str, int] = {}
    for r in rows:
        by_type[r["type"]] = by_type.get(r["type"], 0) + 1
    stamps = {r["type"]: r["created_at"] for r in rows}
    generation_s = (stamps["complete"] - stamps["run_started"]).total_seconds()
    deltas = [r for r in rows if r["type"] == "content_delta"]
    gaps_ms = [(b["created_at"] - a["created_at"]).total_seconds() * 1000
               for a, b in itertools.pairwise(deltas)]
    structural = len(rows) - len(deltas)
    delta_budget = math.ceil(generation_s / FLUSH_S)
    budget = delta_budget + structural
    tokens_in_rows = sum(len(r["payload"]["delta"].split()) for r in deltas)
    emit({
        "benchmark": "journal_rows", "params": params_of(args), "machine": machine,
        "results": {
            "status": status, "generation_s": round(generation_s, 3),
            "nominal_generation_s": nominal_s,
            "rows_total": len(rows), "rows_by_type": by_type,
            "content_delta_rows": len(deltas), "structural_rows": structural,
            "budget_content_delta_rows": delta_budget, "budget_rows_total": budget,
            "tokens_in_journal": tokens_in_rows,
            "gap_between_delta_rows_ms": percentiles(gaps_ms),
        },
        "summary": [
            figure(f"journal rows, {args.tokens} tokens × {args.delay_ms} ms", len(rows), "rows",
                   target=f"≤ {budget} ({delta_budget} + {structural} structural)",
                   met=len(rows) <= budget),
            figure("content_delta rows", len(deltas), "rows"),
        ],
        "seconds": round(time.monotonic() - started, 1),
    })
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
