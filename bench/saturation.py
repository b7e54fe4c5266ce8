"""One daemon far past its comfort: does overload ever cost a live turn its lease?

`--runs` demo turns (default 1,000 of ~45 s each) are posted at once to ONE daemon with
max_runs = runs, a 3 s lease beaten every second and the default pool, one SSE client per turn.
Measured: how the turns end (above all: `failed` with "lease expired" while their worker lived),
whether every client's text equals the stored answer, the peak of concurrently running turns,
and the lease-renewal statements per second the database executed (pg_stat_statements: every
statement that renews a lease, whatever it is called in the version under test).

The same script measures another source tree (for a before/after): run it with PYTHONPATH
pointing at that tree's src/ — the daemon and the migrations then come from there.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from uuid import UUID

import aiohttp
import asyncpg

import agentd
from agentd.providers.demo import expected_answer
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
    peak_concurrent,
    percentiles,
    post_demo_runs,
    progress,
    raise_nofile,
    sse_stream,
)

# Statements that renew a lease set last_heartbeat_at from their clock; the claim sets it too
# (and is told apart by minting the claim token).
RENEWALS = """
SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements
WHERE query LIKE '%last_heartbeat_at = clock.now%'
  AND query NOT LIKE '%claim_token = gen_random_uuid()%'
"""
ALL_STATEMENTS = "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements"


@dataclass
class Client:
    run_id: str
    text: list[str] = field(default_factory=list)
    status: str | None = None
    error: str | None = None


async def watch(http: aiohttp.ClientSession, url: str, client: Client) -> None:
    last = 0
    for _attempt in range(20):
        try:
            async with http.get(f"{url}/v1/runs/{client.run_id}/events",
                                headers={"Last-Event-ID": str(last)}) as resp:
                if resp.status != 200:
                    client.error = f"HTTP {resp.status}"
                    return
                async for event in sse_stream(resp):
                    last = int(event.id or last)
                    if event.event == "content_delta":
                        client.text.append(event.data["delta"])
                    elif event.event == "complete":
                        client.status = event.data.get("status")
                        return
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            client.error = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.5)
    client.error = client.error or "stream ended without complete"


async def counter(dsn: str, sql: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(sql))
    finally:
        await conn.close()


async def main() -> int:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=450)
    parser.add_argument("--delay-ms", type=int, default=100)
    parser.add_argument("--lease-ttl-s", type=float, default=3.0)
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument("--post-concurrency", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--label", default="", help="names the code under test in the JSON")
    args = parser.parse_args()
    if args.quick and args.runs == parser.get_default("runs"):
        args.runs, args.tokens = 100, 100
    if args.dsn:
        raise SystemExit("saturation counts statements with pg_stat_statements: it needs its "
                         "own embedded server (omit --dsn)")
    raise_nofile()
    started = time.monotonic()
    # One bench device follows every turn: room for all its streams and connections.
    settings = daemon_settings(args, max_runs=args.runs, lease_ttl_s=args.lease_ttl_s,
                               heartbeat_s=args.heartbeat_s, streams_per_device=args.runs + 10,
                               max_connections=2 * args.runs + 100)
    pg = {"shared_preload_libraries": "pg_stat_statements", "max_connections": "300"}
    async with bench_database(args, "saturation", pg_settings=pg) as database:
        machine = await machine_info(database)
        pool = await open_pool(database.dsn)
        try:
            await pool.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            token, account_id = await make_account(pool)
            convs = await make_conversations(pool, account_id, args.runs, "saturation")
            async with daemons(database, 1, **settings) as (daemon,), \
                    client_session(token) as http:
                progress(f"{args.runs} turns × {args.tokens} tokens {args.delay_ms} ms apart, "
                         f"lease {args.lease_ttl_s:g} s, heartbeat {args.heartbeat_s:g} s")
                renewals0 = await counter(database.dsn, RENEWALS)
                statements0 = await counter(database.dsn, ALL_STATEMENTS)
                t0 = time.monotonic()
                clients: list[Client] = []
                watchers: list[asyncio.Task[None]] = []

                def attach(run_id: str) -> None:
                    client = Client(run_id)
                    clients.append(client)
                    watchers.append(asyncio.create_task(watch(http, daemon.url, client)))

                prompts = await post_demo_runs(
                    http, daemon.url, convs, label="saturation",
                    concurrency=args.post_concurrency,
                    params={"tokens": args.tokens, "delay_ms": args.delay_ms}, on_posted=attach)
                progress(f"all {args.runs} posted in {time.monotonic() - t0:.1f} s; streaming")
                _done, pending = await asyncio.wait(watchers, timeout=args.timeout)
                for task in pending:
                    task.cancel()
                elapsed = time.monotonic() - t0
                renewals = await counter(database.dsn, RENEWALS) - renewals0
                statements = await counter(database.dsn, ALL_STATEMENTS) - statements0
                progress(f"clients done ({len(pending)} timed out) after {elapsed:.1f} s")
            run_ids = [UUID(r) for r in prompts]
            runs = await pool.fetch("SELECT id, status, error, started_at, finished_at "
                                    "FROM agent_run WHERE id = ANY($1::uuid[])", run_ids)
            answers = {r["run_id"]: (r["content"], r["status"]) for r in await pool.fetch(
                "SELECT run_id, content, status FROM message WHERE role = 'assistant' "
                "AND run_id = ANY($1::uuid[])", run_ids)}
        finally:
            await pool.close()

    statuses = Counter(r["status"] for r in runs)
    expired = [r for r in runs if "lease expired" in (r["error"] or "")]
    exact = 0
    failed_text_lost = 0
    for client in clients:
        answer = answers.get(UUID(client.run_id))
        text = "".join(client.text)
        if answer is not None and text == answer[0]:
            exact += 1
        if client.status == "failed" and text and answer is None:
            failed_text_lost += 1
    full = sum(1 for c in clients if "".join(c.text) ==
               expected_answer("demo", prompts[c.run_id], args.tokens))
    peak = peak_concurrent(runs)
    durations = [(r["finished_at"] - r["started_at"]).total_seconds() for r in runs
                 if r["started_at"] and r["finished_at"]]
    emit({
        "benchmark": "saturation", "params": params_of(args), "machine": machine,
        "code": {"label": args.label, "agentd_path": str(agentd.__file__)},
        "results": {
            "runs": len(runs), "statuses": dict(statuses),
            "failed_lease_expired": len(expired),
            "failed_examples": sorted({r["error"] for r in runs if r["error"]})[:5],
            "clients_text_equals_stored_answer": exact,
            "clients_full_answer": full,
            "failed_turns_whose_streamed_text_vanished": failed_text_lost,
            "peak_concurrent_runs": peak, "elapsed_s": round(elapsed, 1),
            "nominal_run_s": args.tokens * args.delay_ms / 1000,
            "run_duration_s": percentiles(durations),
            "lease_renewal_statements": renewals,
            "lease_renewal_statements_per_s": round(renewals / elapsed, 1),
            "all_statements_per_s": round(statements / elapsed, 1),
        },
        "summary": [
            figure(f"turns failed `lease expired` ({len(runs)} turns, worker alive)",
                   len(expired), "turns", target="0", met=not expired),
            figure("clients whose text equals the stored answer", f"{exact}/{len(clients)}",
                   "", target="all", met=exact == len(clients)),
            figure("lease-renewal statements/s", round(renewals / elapsed, 1), "statements/s"),
            figure("peak concurrent turns", peak, "turns"),
        ],
        "seconds": round(time.monotonic() - started, 1),
    })
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
