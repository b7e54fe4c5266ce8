"""Enqueue → start latency of pgqueuer, measured the way bench/peer.py measures agentd's.

Runs with the peer's own interpreter (pgqueuer is not a dependency of agentd), connects with the
libpq environment variables (PGHOST, PGPORT, PGUSER, PGDATABASE, …) to a database where
`pgq install` has run, and prints ONE JSON object on stdout: the latencies in milliseconds.

An idle consumer runs pgqueuer's normal `PgQueuer.run()` (it LISTENs and dequeues on NOTIFY);
its entrypoint records `time.perf_counter()` when the job starts. A producer in the same process
enqueues one job at a time, each a random gap after the previous one started; latency =
the job's start minus `time.perf_counter()` taken just before its enqueue call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from importlib.metadata import version

import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.queries import Queries

ENTRYPOINT = "latency_probe"


async def measure(jobs: int, warmup: int, gap: tuple[float, float]) -> dict[str, object]:
    consumer_conn = await asyncpg.connect()
    producer_conn = await asyncpg.connect()
    started: dict[int, asyncio.Future[float]] = {}
    loop = asyncio.get_running_loop()

    def future_of(index: int) -> asyncio.Future[float]:
        if index not in started:
            started[index] = loop.create_future()
        return started[index]

    pgq = PgQueuer.from_asyncpg_connection(consumer_conn)

    @pgq.entrypoint(ENTRYPOINT)
    async def probe(job: Job) -> None:
        now = time.perf_counter()
        assert job.payload is not None
        future = future_of(int(job.payload))
        if not future.done():
            future.set_result(now)

    consumer = asyncio.create_task(pgq.run())
    queries = Queries(AsyncpgDriver(producer_conn))
    latencies: list[float] = []
    try:
        await asyncio.sleep(1.0)  # the consumer verified its tables and LISTENs
        for index in range(warmup + jobs):
            await asyncio.sleep(random.uniform(*gap))
            before = time.perf_counter()
            await queries.enqueue(ENTRYPOINT, str(index).encode())
            start = await asyncio.wait_for(asyncio.shield(future_of(index)), timeout=30)
            if index >= warmup:
                latencies.append((start - before) * 1000)
            if consumer.done():
                consumer.result()  # raises what stopped it
                raise RuntimeError("the pgqueuer consumer stopped")
    finally:
        pgq.shutdown.set()
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(consumer, timeout=10)
        if not consumer.done():
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await consumer
        await producer_conn.close()
        with contextlib.suppress(Exception):
            await consumer_conn.close()
    return {"pgqueuer": version("pgqueuer"), "asyncpg": version("asyncpg"),
            "python": sys.version.split()[0], "event_loop": "asyncio",
            "jobs": jobs, "warmup": warmup, "latencies_ms": latencies}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5, help="jobs run first and not counted")
    parser.add_argument("--min-gap-ms", type=float, default=5.0)
    parser.add_argument("--max-gap-ms", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    random.seed(args.seed)
    result = asyncio.run(measure(args.jobs, args.warmup,
                                 (args.min_gap_ms / 1000, args.max_gap_ms / 1000)))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
