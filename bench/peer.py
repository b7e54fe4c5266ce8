"""Side by side with a peer: agentd and pgqueuer 1.6.0 on the same PostgreSQL, in one run.

    python bench/peer.py                 # full budget: bench/results/peer.json
    python bench/peer.py --quick         # smoke test: bench/results/quick/peer.json

The peer is set up at run time and never vendored: a private virtualenv (bench/.peer/, ignored
by git) gets `pgqueuer[asyncpg]==1.6.0` and the packages its benchmark imports, and pgqueuer's
own `tools/benchmark.py` is taken from its 1.6.0 source distribution on PyPI. Every measured
configuration gets a fresh database on the one server (pgqueuer's schema installed by its own
`pgq install`, agentd's by its migrations), after a CHECKPOINT, so neither inherits the other's
bloat or dirty pages.

1. No-op throughput, the same time budget for both. pgqueuer: its tools/benchmark.py, strategy
   `throughput` (N dequeue tasks, E enqueue tasks enqueuing batches). agentd, the same shape in
   our code with the daemon's machinery: N consumer tasks each looping `claim_runs(limit=b)`
   then ending each claimed turn at once (its terminal write shares one statement with the
   others ending then: `finish_runs`, group_commit.Batcher); E enqueuer tasks each enqueuing
   batches of the same size as pgqueuer's in one statement (`enqueue_runs`) over a pool of
   conversations far larger than the runs in flight, so the one-turn-per-conversation rule
   never throttles. Idle consumers wait on the hub (LISTEN), as pgqueuer's do. Jobs/s =
   jobs done / time from the consumers' start until they stopped, as pgqueuer computes it.
2. Drain: the same consumers on a pre-filled backlog (pgqueuer: its benchmark's `drain`
   strategy), at each system's best batch from part 1 — the consumers' side alone, which part 1
   cannot show when the enqueuers are the slower side (`backlog_kept` false).
3. Enqueue → start latency, measured identically for both: an idle consumer waiting on
   LISTEN/NOTIFY (agentd: a Hub subscription on run_enqueued, then claim_runs; pgqueuer: its
   normal `PgQueuer.run()`, see bench/peer_latency_pgqueuer.py), a producer in the same process
   enqueuing one job at a time at random gaps; latency = the consumer's `time.perf_counter()`
   when the job starts minus the producer's just before the enqueue call. Both on asyncio's
   default event loop.

An agentd run is not a pgqueuer job: enqueue writes the user message, the run row and two
journal events and sends two NOTIFYs; the claim updates the run, the message and upserts the
conversation lease; the finish writes the run, the `complete` event and releases the lease, with
two NOTIFYs (an ending's wake goes to its own process's claim loop only: notifier.py; here every
consumer claims again once its turns have ended, which is what that loop does). The figures show
what those guarantees cost, not two equal workloads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import random
import resource
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import asyncpg

from agentd import __version__ as agentd_version
from agentd import db as dbmod
from agentd import statistics
from agentd.group_commit import Batcher
from agentd.hub import Hub
from agentd.notifier import Notifier
from agentd.queue import (
    Claim,
    Finishes,
    Hint,
    NewRun,
    claim_runs,
    enqueue_run,
    enqueue_runs,
    finish_run_journaled,
    finish_runs,
)
from agentd.settings import Settings
from agentd.vocabulary import Channel, RunStatus
from harness import (
    BENCH_DSN_ENV,
    UNBOUNDED_ACCOUNT,
    BenchDatabase,
    bench_database,
    emit,
    figure,
    machine_info,
    make_account,
    make_conversations,
    percentiles,
    progress,
    tree_cpu_seconds,
    with_database,
)

BENCH = Path(__file__).resolve().parent
PEER = "pgqueuer"
PEER_VERSION = "1.6.0"
PEER_PACKAGES = [f"pgqueuer[asyncpg]=={PEER_VERSION}", "typer", "uvloop", "tqdm", "tabulate"]
PEER_IMPORTS = ("pgqueuer", "asyncpg", "typer", "uvloop", "tqdm", "tabulate", "pydantic")
BENCHMARK_MEMBER = f"pgqueuer-{PEER_VERSION}/tools/benchmark.py"
# One account carries the whole load: its limits are not what this compares.
UNBOUNDED_RUNNING = UNBOUNDED_ACCOUNT["account_max_running"]
UNBOUNDED_QUEUED = UNBOUNDED_ACCOUNT["account_max_queued"]
PEER_DURABILITY = "durable"  # `pgq install`'s default: logged tables, like agentd's
TARGET_RATIO_BATCH1 = 1.0  # agentd's no-op runs/s over pgqueuer's jobs/s, batch 1
TARGET_RATIO_BEST = 0.5  # the same at each one's best batch


class _ConsumersClaimAgain:
    """The consumers as the notifier sees a claim loop: each claims again as soon as its turns
    have ended, so an ending's wake, owed to them alone, is acted on without being heard."""

    def claims(self) -> bool:
        return True

    def owe_wake(self, committed_by: float, wakes: int) -> None:
        pass


CONSUMERS = _ConsumersClaimAgain()


def consumers_machinery(pool: asyncpg.Pool) -> tuple[Notifier, Finishes]:
    """The daemon's machinery the consumers share: hints sent after commit, batched (an
    ending's wake goes to the consumers alone, as to a daemon's own claim loop: notifier.py),
    and the terminal writes of turns ending together in one statement (group_commit.py)."""
    notifier = Notifier(pool, claim_loop=lambda: CONSUMERS)
    notifier.start()
    return notifier, Batcher(pool, lambda items: finish_runs(pool, items))


# -- the peer, set up at run time ------------------------------------------------------------

@dataclass(frozen=True)
class Peer:
    python: Path
    pgq: Path
    benchmark: Path
    benchmark_sha256: str
    versions: dict[str, str]


def _run(command: Sequence[str | Path], *, what: str, env: Mapping[str, str] | None = None,
         timeout: float = 900, log: Path | None = None) -> str:
    """Run a program; its output goes to `log` (or is returned); fail loudly with its tail."""
    argv = [str(c) for c in command]
    if log is not None:
        with open(log, "ab") as out:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                  check=False)
        output = log.read_text(errors="replace")
    else:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              env=env, timeout=timeout, check=False)
        output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{output[-4000:]}")
    return proc.stdout if log is None else output


def _peer_versions(python: Path) -> dict[str, str] | None:
    """The peer venv's package versions, or None when something it needs is missing."""
    probe = ("import importlib, importlib.metadata as m, json, sys\n"
             f"names = {PEER_IMPORTS!r}\n"
             "for n in names: importlib.import_module(n)\n"
             "print(json.dumps({n: m.version(n) for n in names}))")
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                          check=False, timeout=120)
    if proc.returncode != 0:
        return None
    versions = json.loads(proc.stdout)
    return versions if versions.get(PEER) == PEER_VERSION else None


def setup_peer(peer_dir: Path) -> Peer:
    """A private venv with pgqueuer, and pgqueuer's tools/benchmark.py from its sdist."""
    peer_dir.mkdir(parents=True, exist_ok=True)
    venv = peer_dir / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        progress("creating the peer's virtualenv")
        _run([sys.executable, "-m", "venv", venv], what="python -m venv")
    versions = _peer_versions(python)
    if versions is None:
        progress(f"installing {' '.join(PEER_PACKAGES)} into the peer's virtualenv")
        _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              *PEER_PACKAGES], what="pip install (peer)")
        versions = _peer_versions(python)
        if versions is None:
            raise SystemExit(f"the peer's virtualenv lacks one of {PEER_IMPORTS} after pip")
    sdist_dir = peer_dir / "sdist"
    sdist = sdist_dir / f"pgqueuer-{PEER_VERSION}.tar.gz"
    if not sdist.exists():
        progress(f"downloading the pgqueuer {PEER_VERSION} source distribution")
        _run([python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
              f"pgqueuer=={PEER_VERSION}", "--no-binary", ":all:", "--no-deps",
              "-d", sdist_dir], what="pip download (peer sdist)")
    benchmark = peer_dir / f"pgqueuer-{PEER_VERSION}-tools" / "benchmark.py"
    with tarfile.open(sdist) as archive:
        member = archive.extractfile(BENCHMARK_MEMBER)
        if member is None:
            raise SystemExit(f"{sdist.name} has no {BENCHMARK_MEMBER}")
        source = member.read()
    benchmark.parent.mkdir(parents=True, exist_ok=True)
    benchmark.write_bytes(source)
    # Its options, read from the file itself rather than assumed.
    for option in ("throughput", '"--time"', "dequeue_batch_size", "enqueue_batch_size",
                   "output_json"):
        if option.encode() not in source:
            raise SystemExit(f"pgqueuer's tools/benchmark.py has no {option} option")
    return Peer(python, venv / "bin" / "pgq", benchmark, hashlib.sha256(source).hexdigest(),
                versions)


def libpq_env(dsn: str) -> dict[str, str]:
    """This environment with PG* variables naming `dsn` (pgqueuer's benchmark reads only these).

    A unix-socket DSN (postgresql://user@/db?host=/socket/dir&port=…) gives PGHOST = the socket
    directory, which libpq and asyncpg both understand.
    """
    parts = urlsplit(dsn)
    query = dict(parse_qsl(parts.query))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PG", "PGQUEUER_")) and k != "TABLEFMT"}
    values = {
        "PGHOST": query.get("host") or (unquote(parts.hostname) if parts.hostname else None),
        "PGPORT": query.get("port") or (str(parts.port) if parts.port else None),
        "PGUSER": query.get("user") or (unquote(parts.username) if parts.username else None),
        "PGPASSWORD": query.get("password") or (unquote(parts.password)
                                                 if parts.password else None),
        "PGDATABASE": unquote(parts.path.lstrip("/")) or None,
        "PGSSLMODE": query.get("sslmode"),
        # The embedded server authenticates with a password kept in a file the DSN names.
        "PGPASSFILE": query.get("passfile"),
    }
    env.update({k: v for k, v in values.items() if v})
    env["PYTHONUNBUFFERED"] = "1"
    return env


# -- databases -------------------------------------------------------------------------------

class Databases:
    """Fresh databases on the shared server: agentd's (migrated) and pgqueuer's (pgq install)."""

    def __init__(self, first: BenchDatabase, peer: Peer, workdir: Path) -> None:
        self.first = first
        self.peer = peer
        self.workdir = workdir
        self._peer_names: list[str] = []

    async def checkpoint(self) -> None:
        """Start every configuration from clean buffers (needs a superuser; skipped if not)."""
        conn = await asyncpg.connect(self.first.admin_dsn)
        try:
            with contextlib.suppress(asyncpg.PostgresError):
                await conn.execute("CHECKPOINT")
        finally:
            await conn.close()

    async def agentd(self, label: str) -> BenchDatabase:
        database = await self.first.fresh(label)
        await self.checkpoint()
        return database

    async def pgqueuer(self, label: str) -> str:
        """A fresh database with pgqueuer's schema, installed by its own CLI; returns its DSN."""
        name = f"pgqueuer_bench_{label}_{uuid.uuid4().hex[:8]}"
        conn = await asyncpg.connect(self.first.admin_dsn)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')  # ours: a fixed prefix + hex
        finally:
            await conn.close()
        self._peer_names.append(name)
        dsn = with_database(self.first.admin_dsn, name)
        await asyncio.to_thread(
            _run, [self.peer.pgq, "install", "--durability", PEER_DURABILITY],
            what="pgq install", env=libpq_env(dsn), timeout=120,
            log=self.workdir / f"pgq-install-{label}.log")
        await self.checkpoint()
        return dsn

    async def drop_peer_databases(self) -> None:
        conn = await asyncpg.connect(self.first.admin_dsn)
        try:
            for name in self._peer_names:
                with contextlib.suppress(asyncpg.PostgresError):
                    await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


@dataclass
class Costs:
    """CPU (client process, PostgreSQL) and WAL written over one configuration."""

    server_pid: int | None
    dsn: str
    client: Any = None  # a callable returning the client's CPU seconds so far
    _cpu: float = 0.0
    _pg: float | None = None
    _lsn: str | None = None
    _load: float = 0.0

    async def __aenter__(self) -> Costs:
        self._load = os.getloadavg()[0]
        self._cpu = self.client()
        self._pg = tree_cpu_seconds(self.server_pid) if self.server_pid else None
        self._lsn = await _wal_lsn(self.dsn)
        self.result: dict[str, Any] = {}
        return self

    async def __aexit__(self, *exc: object) -> None:
        wal = await _wal_bytes_since(self.dsn, self._lsn)
        self.result = {
            "client_cpu_s": round(self.client() - self._cpu, 2),
            "postgres_cpu_s": (round(tree_cpu_seconds(self.server_pid) - self._pg, 2)
                               if self._pg is not None else None),
            "wal_bytes": wal,
            "loadavg_1m_before_after": [round(self._load, 2), round(os.getloadavg()[0], 2)],
        }

    def per_job(self, jobs: int) -> dict[str, Any]:
        r = self.result
        if not jobs:
            return {}
        return {
            "client_cpu_ms_per_job": round(r["client_cpu_s"] * 1000 / jobs, 3),
            "postgres_cpu_ms_per_job": (round(r["postgres_cpu_s"] * 1000 / jobs, 3)
                                        if r["postgres_cpu_s"] is not None else None),
            "wal_bytes_per_job": round(r["wal_bytes"] / jobs) if r["wal_bytes"] else None,
        }


async def _wal_lsn(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT pg_current_wal_lsn()::text")
    finally:
        await conn.close()


async def _wal_bytes_since(dsn: str, lsn: str | None) -> int | None:
    if lsn is None:
        return None
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)", lsn))
    finally:
        await conn.close()


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- throughput ------------------------------------------------------------------------------

async def pgqueuer_throughput(dbs: Databases, args: argparse.Namespace,
                              batch: int) -> dict[str, Any]:
    dsn = await dbs.pgqueuer(f"tp{batch}")
    out = dbs.workdir / f"pgqueuer-throughput-b{batch}.json"
    command = [dbs.peer.python, dbs.peer.benchmark, "--strategy", "throughput",
               "-t", str(args.time), "--dequeue", str(args.consumers),
               "--dequeue-batch-size", str(batch), "--enqueue", str(args.enqueuers),
               "--enqueue-batch-size", str(args.enqueue_batch)]
    progress(f"pgqueuer throughput, dequeue batch {batch}: {args.time:g} s")
    async with Costs(dbs.first.server_pid, dsn, _children_cpu) as costs:
        await asyncio.to_thread(
            _run, [*command, "--output-json", out], what="pgqueuer tools/benchmark.py",
            env=libpq_env(dsn), timeout=args.time * 3 + 120,
            log=dbs.workdir / f"pgqueuer-throughput-b{batch}.log")
    raw = json.loads(out.read_text())
    jobs = int(raw["steps"])
    rate = float(raw["rate"])
    progress(f"pgqueuer throughput, dequeue batch {batch}: {rate:,.0f} jobs/s")
    return {
        "dequeue_batch": batch, "jobs_per_s": round(rate, 1), "jobs": jobs,
        "elapsed_s": raw["elapsed"], "left_queued": raw["queued"],
        "backlog_kept": raw["queued"] >= args.consumers * batch,
        **costs.result, **costs.per_job(jobs),
        "command": " ".join(["python", "tools/benchmark.py",
                             *map(str, command[2:]), "--output-json", "FILE"]),
        "benchmark_output": raw,
    }


async def agentd_throughput(dbs: Databases, args: argparse.Namespace,
                            batch: int) -> dict[str, Any]:
    database = await dbs.agentd(f"tp{batch}")
    settings = Settings()
    size = args.consumers + args.enqueuers
    pool = await dbmod.create_pool(database.dsn, min_size=size, max_size=size + 1,
                                   application_name="agentd-bench-peer")
    notifier, finishes = consumers_machinery(pool)
    analyzing = asyncio.create_task(statistics.keep_fresh_forever(pool))
    hub = Hub(database.dsn, channels=[Channel.RUN_ENQUEUED])
    try:
        _token, account_id = await make_account(pool)
        conversations = await make_conversations(pool, account_id, args.conversations, "peer")
        await hub.start()
        stop = asyncio.Event()
        numbers = itertools.count()
        counts = {"enqueued": 0, "claimed": 0, "finished": 0, "empty_claims": 0}

        async def enqueuer() -> None:
            while not stop.is_set():
                batch = [noop_run(next(numbers), conversations)
                         for _ in range(args.enqueue_batch)]
                await enqueue_runs(pool, account_id=account_id, runs=batch,
                                   default_max_queued=UNBOUNDED_QUEUED)
                counts["enqueued"] += args.enqueue_batch
                await asyncio.sleep(0)

        async def consumer(worker: int) -> None:
            async with hub.subscribe(Channel.RUN_ENQUEUED) as wake:
                while not stop.is_set():
                    wake.clear()
                    claims = await claim_runs(pool, worker_id=f"peer-bench-{worker}",
                                              lease_ttl_s=settings.lease_ttl_s, limit=batch,
                                              default_max_running=UNBOUNDED_RUNNING,
                                              hint=notifier.notify)
                    if not claims:
                        counts["empty_claims"] += 1
                        await wake.wait(settings.tick_s)
                        continue
                    counts["claimed"] += len(claims)
                    await asyncio.gather(*(noop_turn(pool, claim, notifier.notify, finishes)
                                           for claim in claims))
                    counts["finished"] += len(claims)

        progress(f"agentd throughput, claim batch {batch}: {args.time:g} s")
        async with Costs(database.server_pid, database.dsn, _own_cpu) as costs:
            started = time.perf_counter()
            consumers = [asyncio.create_task(consumer(i)) for i in range(args.consumers)]
            enqueuers = [asyncio.create_task(enqueuer()) for _ in range(args.enqueuers)]
            await asyncio.sleep(args.time)
            stop.set()
            # Idle consumers park on the hub: wake them so they see the stop.
            async with pool.acquire() as conn:
                await conn.execute("SELECT pg_notify($1, '')", Channel.RUN_ENQUEUED.value)
            await asyncio.gather(*consumers, *enqueuers)
            elapsed = time.perf_counter() - started
        left = await pool.fetchval("SELECT count(*) FROM agent_run WHERE status = 'queued'")
        completed = await pool.fetchval(
            "SELECT count(*) FROM agent_run WHERE status = 'completed'")
    finally:
        analyzing.cancel()
        await hub.close()
        await notifier.close()
        await pool.close()
    rate = counts["finished"] / elapsed
    progress(f"agentd throughput, claim batch {batch}: {rate:,.0f} runs/s")
    return {
        "claim_batch": batch, "runs_per_s": round(rate, 1), "runs": counts["finished"],
        "completed_rows": completed, "elapsed_s": round(elapsed, 3), "left_queued": left,
        "backlog_kept": left >= args.consumers * batch,
        "enqueued": counts["enqueued"], "empty_claims": counts["empty_claims"],
        **costs.result, **costs.per_job(counts["finished"]),
    }


def noop_run(n: int, conversations: Sequence[uuid.UUID]) -> NewRun:
    """The n-th no-op turn, over the pool of conversations in turn."""
    content = f"noop {n}"
    return NewRun(conversations[n % len(conversations)], content,
                  {"content": content, "model": "demo", "params": {}})


async def noop_turn(db: asyncpg.Pool, claim: Claim, hint: Hint, finishes: Finishes) -> None:
    """A turn that does nothing: the terminal write right after the claim, through the
    daemon's own machinery — terminal writes of turns ending together share one statement
    (group commit), hints batched after the commit by its Notifier — as in `agentd serve`."""
    await finish_run_journaled(db, claim, RunStatus.COMPLETED, last=(),
                               seq=claim.last_seq + 1, hint=hint, finishes=finishes)


# -- drain: consumers only -------------------------------------------------------------------

async def pgqueuer_drain(dbs: Databases, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    dsn = await dbs.pgqueuer(f"dr{batch}")
    out = dbs.workdir / f"pgqueuer-drain-b{batch}.json"
    command = [dbs.peer.python, dbs.peer.benchmark, "--strategy", "drain",
               "--jobs", str(args.drain_jobs), "--dequeue", str(args.consumers),
               "--dequeue-batch-size", str(batch)]
    progress(f"pgqueuer drain of {args.drain_jobs} jobs, dequeue batch {batch}")
    await asyncio.to_thread(
        _run, [*command, "--output-json", out], what="pgqueuer tools/benchmark.py (drain)",
        env=libpq_env(dsn), timeout=args.drain_jobs / 20 + 300,
        log=dbs.workdir / f"pgqueuer-drain-b{batch}.log")
    raw = json.loads(out.read_text())
    rate = float(raw["rate"])
    progress(f"pgqueuer drain, dequeue batch {batch}: {rate:,.0f} jobs/s")
    return {"dequeue_batch": batch, "jobs_per_s": round(rate, 1), "jobs": int(raw["steps"]),
            "elapsed_s": raw["elapsed"],
            "command": " ".join(["python", "tools/benchmark.py", *map(str, command[2:]),
                                 "--output-json", "FILE"]),
            "benchmark_output": raw}


async def agentd_drain(dbs: Databases, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """The same as pgqueuer's drain: a pre-filled backlog, N consumers, time until it is gone."""
    database = await dbs.agentd(f"dr{batch}")
    settings = Settings()
    pool = await dbmod.create_pool(database.dsn, min_size=args.consumers,
                                   max_size=args.consumers + 1,
                                   application_name="agentd-bench-peer")
    notifier, finishes = consumers_machinery(pool)
    analyzing = asyncio.create_task(statistics.keep_fresh_forever(pool))
    jobs = args.drain_jobs
    try:
        _token, account_id = await make_account(pool)
        conversations = await make_conversations(pool, account_id, args.conversations, "drain")
        progress(f"agentd drain: enqueueing {jobs} runs")
        for first in range(0, jobs, 500):
            await enqueue_runs(pool, account_id=account_id, default_max_queued=UNBOUNDED_QUEUED,
                               runs=[noop_run(n, conversations)
                                     for n in range(first, min(first + 500, jobs))])
        await dbs.checkpoint()
        counts = {"claimed": 0, "finished": 0}

        async def consumer(worker: int) -> None:
            while counts["claimed"] < jobs:
                claims = await claim_runs(pool, worker_id=f"peer-drain-{worker}",
                                          lease_ttl_s=settings.lease_ttl_s, limit=batch,
                                          default_max_running=UNBOUNDED_RUNNING,
                                          hint=notifier.notify)
                if not claims:
                    await asyncio.sleep(0.001)  # a lost race; runs are left
                    continue
                counts["claimed"] += len(claims)
                await asyncio.gather(*(noop_turn(pool, claim, notifier.notify, finishes)
                                       for claim in claims))
                counts["finished"] += len(claims)

        progress(f"agentd drain of {jobs} runs, claim batch {batch}")
        started = time.perf_counter()
        await asyncio.gather(*(consumer(i) for i in range(args.consumers)))
        elapsed = time.perf_counter() - started
    finally:
        analyzing.cancel()
        await notifier.close()
        await pool.close()
    rate = counts["finished"] / elapsed
    progress(f"agentd drain, claim batch {batch}: {rate:,.0f} runs/s")
    return {"claim_batch": batch, "runs_per_s": round(rate, 1), "runs": counts["finished"],
            "elapsed_s": round(elapsed, 3)}


# -- latency ---------------------------------------------------------------------------------

async def agentd_latency(dbs: Databases, args: argparse.Namespace) -> dict[str, Any]:
    database = await dbs.agentd("lat")
    settings = Settings()
    pool = await dbmod.create_pool(database.dsn, min_size=2, max_size=4,
                                   application_name="agentd-bench-peer")
    notifier, finishes = consumers_machinery(pool)
    hub = Hub(database.dsn, channels=[Channel.RUN_ENQUEUED])
    total = args.latency_warmup + args.latency_jobs
    loop = asyncio.get_running_loop()
    started: dict[uuid.UUID, asyncio.Future[float]] = {}

    def future_of(run_id: uuid.UUID) -> asyncio.Future[float]:
        if run_id not in started:
            started[run_id] = loop.create_future()
        return started[run_id]

    async def consumer() -> None:
        async with hub.subscribe(Channel.RUN_ENQUEUED) as wake:
            while True:
                wake.clear()
                claims = await claim_runs(pool, worker_id="peer-latency",
                                          lease_ttl_s=settings.lease_ttl_s, limit=1,
                                          default_max_running=UNBOUNDED_RUNNING)
                if not claims:
                    await wake.wait(settings.tick_s)
                    continue
                now = time.perf_counter()
                for claim in claims:
                    future = future_of(claim.run_id)
                    if not future.done():
                        future.set_result(now)
                for claim in claims:
                    await noop_turn(pool, claim, notifier.notify, finishes)

    latencies: list[float] = []
    try:
        _token, account_id = await make_account(pool)
        conversations = await make_conversations(pool, account_id, total, "latency")
        await hub.start()
        task = asyncio.create_task(consumer())
        await asyncio.sleep(1.0)
        progress(f"agentd latency: {args.latency_jobs} runs one at a time, "
                 f"{args.min_gap_ms:g}-{args.max_gap_ms:g} ms apart")
        gap = (args.min_gap_ms / 1000, args.max_gap_ms / 1000)
        for i in range(total):
            await asyncio.sleep(random.uniform(*gap))
            content = f"latency {i}"
            before = time.perf_counter()
            run = await enqueue_run(pool, account_id=account_id,
                                    conversation_id=conversations[i], content=content,
                                    request={"content": content, "model": "demo",
                                             "params": {}},
                                    default_max_queued=UNBOUNDED_QUEUED)
            start = await asyncio.wait_for(asyncio.shield(future_of(run.run_id)), timeout=30)
            if i >= args.latency_warmup:
                latencies.append((start - before) * 1000)
            if task.done():
                task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await hub.close()
        await notifier.close()
        await pool.close()
    return {"enqueue_to_start_ms": percentiles(latencies), "hub_notifications": hub.notifications}


async def pgqueuer_latency(dbs: Databases, args: argparse.Namespace) -> dict[str, Any]:
    dsn = await dbs.pgqueuer("lat")
    progress(f"pgqueuer latency: {args.latency_jobs} jobs one at a time, "
             f"{args.min_gap_ms:g}-{args.max_gap_ms:g} ms apart")
    command = [dbs.peer.python, BENCH / "peer_latency_pgqueuer.py",
               "--jobs", str(args.latency_jobs), "--warmup", str(args.latency_warmup),
               "--min-gap-ms", str(args.min_gap_ms), "--max-gap-ms", str(args.max_gap_ms),
               "--seed", str(args.seed)]
    stdout = await asyncio.to_thread(_run, command, what="peer_latency_pgqueuer.py",
                                     env=libpq_env(dsn), timeout=args.latency_jobs * 2 + 120)
    raw = json.loads(stdout.strip().splitlines()[-1])
    return {"enqueue_to_start_ms": percentiles(raw["latencies_ms"]),
            "probe": {k: v for k, v in raw.items() if k != "latencies_ms"}}


# -- the run ---------------------------------------------------------------------------------

def _memory_gib() -> float | None:
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return None


def _batches(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _best(rows: list[dict[str, Any]], key: str, batch_key: str) -> dict[str, Any]:
    return max((r for r in rows if r[batch_key] != 1), key=lambda r: r[key],
               default=max(rows, key=lambda r: r[key]))


def _batch1(rows: list[dict[str, Any]], batch_key: str) -> dict[str, Any] | None:
    return next((r for r in rows if r[batch_key] == 1), None)


def _command_line() -> str:
    """This run's command, without the value of --dsn (it may hold a password)."""
    words, hide = ["python", "bench/peer.py"], False
    for word in sys.argv[1:]:
        words.append("DSN" if hide else ("--dsn=DSN" if word.startswith("--dsn=") else word))
        hide = word == "--dsn"
    return " ".join(words)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get(BENCH_DSN_ENV),
                        help="a PostgreSQL server to use (a role that may CREATE DATABASE); "
                        f"default: ${BENCH_DSN_ENV}, else a throwaway embedded PostgreSQL")
    parser.add_argument("--quick", action="store_true", help="short budgets, for a smoke test")
    parser.add_argument("--pg-fast", action="store_true",
                        help="embedded server without durability (fsync off)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--peer-dir", type=Path, default=BENCH / ".peer",
                        help="where the peer's virtualenv and benchmark live (git-ignored)")
    parser.add_argument("--time", type=float, default=15.0,
                        help="seconds per throughput configuration, both systems (15)")
    parser.add_argument("--consumers", type=int, default=5,
                        help="dequeue/consumer tasks, both systems (5, pgqueuer's default)")
    parser.add_argument("--enqueuers", type=int, default=2,
                        help="enqueue tasks, both systems (2; pgqueuer's default of 1 lets "
                        "either system's consumers run the queue dry)")
    parser.add_argument("--enqueue-batch", type=int, default=10,
                        help="jobs per enqueue commit, both systems (10, pgqueuer's default)")
    parser.add_argument("--pgqueuer-batches", type=_batches, default=[1, 10, 50],
                        help="pgqueuer dequeue batch sizes (1,10,50)")
    parser.add_argument("--agentd-batches", type=_batches, default=[1, 5, 10, 25, 50],
                        help="agentd claim batch sizes (1,5,10,25,50)")
    parser.add_argument("--conversations", type=int, default=2000,
                        help="agentd conversations the enqueuers rotate over (2000)")
    parser.add_argument("--drain-jobs", type=int, default=10000,
                        help="backlog drained at each system's best batch (10000)")
    parser.add_argument("--latency-jobs", type=int, default=200)
    parser.add_argument("--latency-warmup", type=int, default=5)
    parser.add_argument("--min-gap-ms", type=float, default=5.0)
    parser.add_argument("--max-gap-ms", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--skip", choices=("throughput", "drain", "latency"), action="append",
                        default=[], help="leave a part out (repeatable)")
    args = parser.parse_args()
    if args.quick:
        args.time = min(args.time, 3.0)
        args.latency_jobs = min(args.latency_jobs, 30)
        args.drain_jobs = min(args.drain_jobs, 1000)
        args.pgqueuer_batches = args.pgqueuer_batches[:2]
        args.agentd_batches = args.agentd_batches[:3]
    in_flight = args.consumers * max(args.agentd_batches)
    if args.conversations < 4 * in_flight:
        parser.error(f"--conversations must be at least 4 x the runs in flight ({in_flight})")
    return args


async def main() -> int:
    args = parse_args()
    random.seed(args.seed)
    started = time.monotonic()
    peer = await asyncio.to_thread(setup_peer, args.peer_dir)
    progress(f"peer ready: pgqueuer {peer.versions[PEER]}")
    throughput: dict[str, list[dict[str, Any]]] = {"pgqueuer": [], "agentd": []}
    drain: dict[str, dict[str, Any]] = {}
    latency: dict[str, Any] = {}
    async with bench_database(args, "peer") as first:
        machine = await machine_info(first)
        dbs = Databases(first, peer, first.workdir)
        try:
            if "throughput" not in args.skip:
                # Alternate the two systems, so a drift in the machine's load hits both alike.
                for pq_batch, ag_batch in itertools.zip_longest(args.pgqueuer_batches,
                                                                args.agentd_batches):
                    if pq_batch is not None:
                        throughput["pgqueuer"].append(
                            await pgqueuer_throughput(dbs, args, pq_batch))
                    if ag_batch is not None:
                        throughput["agentd"].append(
                            await agentd_throughput(dbs, args, ag_batch))
            if "drain" not in args.skip:
                # The backlog is there from the start: the consumers' side alone, at the best
                # batch each system reached in the throughput part (or the largest asked for).
                pq_batch = (_best(throughput["pgqueuer"], "jobs_per_s", "dequeue_batch")
                            ["dequeue_batch"] if throughput["pgqueuer"]
                            else max(args.pgqueuer_batches))
                ag_batch = (_best(throughput["agentd"], "runs_per_s", "claim_batch")
                            ["claim_batch"] if throughput["agentd"]
                            else max(args.agentd_batches))
                drain["pgqueuer"] = await pgqueuer_drain(dbs, args, pq_batch)
                drain["agentd"] = await agentd_drain(dbs, args, ag_batch)
            if "latency" not in args.skip:
                latency["pgqueuer"] = await pgqueuer_latency(dbs, args)
                latency["agentd"] = await agentd_latency(dbs, args)
        finally:
            await dbs.drop_peer_databases()
    machine["memory_gib"] = _memory_gib()
    versions = {
        "agentd": agentd_version, "pgqueuer": peer.versions[PEER],
        "postgresql": machine["postgresql"], "python": machine["python"],
        "asyncpg (agentd)": machine["versions"].get("asyncpg"),
        "asyncpg (pgqueuer)": peer.versions["asyncpg"],
        "uvloop (pgqueuer's benchmark)": peer.versions["uvloop"],
    }

    summary: list[dict[str, Any]] = []
    if throughput["pgqueuer"] and throughput["agentd"]:
        pq, ag = throughput["pgqueuer"], throughput["agentd"]
        pq1, ag1 = _batch1(pq, "dequeue_batch"), _batch1(ag, "claim_batch")
        pqb, agb = _best(pq, "jobs_per_s", "dequeue_batch"), _best(ag, "runs_per_s",
                                                                      "claim_batch")

        def dry(row: dict[str, Any]) -> str:
            return "" if row["backlog_kept"] else ", queue ran dry"

        if pq1:
            summary.append(figure(f"pgqueuer no-op jobs/s, batch 1{dry(pq1)}",
                                  pq1["jobs_per_s"], "jobs/s"))
        summary.append(figure(
            f"pgqueuer no-op jobs/s, best batch ({pqb['dequeue_batch']}{dry(pqb)})",
            pqb["jobs_per_s"], "jobs/s"))
        if ag1:
            summary.append(figure(f"agentd no-op runs/s, batch 1{dry(ag1)}",
                                  ag1["runs_per_s"], "runs/s"))
        summary.append(figure(
            f"agentd no-op runs/s, best batch ({agb['claim_batch']}{dry(agb)})",
            agb["runs_per_s"], "runs/s"))
        if ag1 and pq1:
            ratio1 = round(ag1["runs_per_s"] / pq1["jobs_per_s"], 3)
            summary.append(figure("agentd / pgqueuer, batch 1", ratio1, "×",
                                  target=f"≥ {TARGET_RATIO_BATCH1:g}",
                                  met=ratio1 >= TARGET_RATIO_BATCH1))
        best = round(agb["runs_per_s"] / pqb["jobs_per_s"], 3)
        summary.append(figure("agentd / pgqueuer, best batch", best, "×",
                              target=f"≥ {TARGET_RATIO_BEST:g}", met=best >= TARGET_RATIO_BEST))
        for name, row in (("pgqueuer", pqb), ("agentd", agb)):
            summary.append(figure(f"{name} WAL bytes per job, best batch",
                                  row.get("wal_bytes_per_job"), "B"))
    if drain:
        summary.append(figure(
            f"pgqueuer drain jobs/s, batch {drain['pgqueuer']['dequeue_batch']}",
            drain["pgqueuer"]["jobs_per_s"], "jobs/s"))
        summary.append(figure(f"agentd drain runs/s, batch {drain['agentd']['claim_batch']}",
                              drain["agentd"]["runs_per_s"], "runs/s"))
        summary.append(figure("agentd / pgqueuer, drain", round(
            drain["agentd"]["runs_per_s"] / drain["pgqueuer"]["jobs_per_s"], 3), "×"))
    for name in ("pgqueuer", "agentd"):
        if name in latency:
            lat = latency[name]["enqueue_to_start_ms"]
            summary.append(figure(f"{name} enqueue → start p50", lat.get("p50"), "ms"))
            summary.append(figure(f"{name} enqueue → start p99", lat.get("p99"), "ms"))

    result = {
        "benchmark": "peer",
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k not in ("dsn", "keep", "peer_dir")}
        | {"server": "external" if args.dsn else "embedded"},
        "machine": machine,
        "versions": versions,
        "peer": {
            "packages": PEER_PACKAGES,
            "benchmark": f"tools/benchmark.py from the pgqueuer {PEER_VERSION} sdist on PyPI",
            "benchmark_sha256": peer.benchmark_sha256,
            "schema": f"pgq install --durability {PEER_DURABILITY}",
            "versions": peer.versions,
        },
        "results": {"throughput": throughput, "drain": drain, "latency": latency},
        "summary": summary,
        "notes": [
            "Same PostgreSQL server, same run; each configuration on a fresh database after a "
            "CHECKPOINT; configurations run one after the other, never at once.",
            "Work per job differs by design. A pgqueuer job is one queue row: inserted per "
            "enqueue batch, picked per dequeue batch, deleted into its log table per ack batch "
            "(one statement-level NOTIFY trigger per statement). An agentd run writes, on "
            "enqueue, the "
            "user message, the run row and 2 journal events (+2 NOTIFYs); on claim, the run "
            "row, the message status, the conversation-lease upsert and run_started; on "
            "finish, the run row, the answer, the 'complete' journal event and the lease "
            "release (+3 hints), the finishes of runs ending together in one statement. The "
            "throughput ratio is the price of those guarantees (durable "
            "transcript, fenced at-most-once execution, one turn per conversation, a "
            "replayable journal), not of equal work.",
            "pgqueuer's throughput comes from its own tools/benchmark.py (uvloop, one asyncpg "
            "connection per task, acks buffered per batch); agentd's from this script with the "
            "daemon's own machinery (asyncio event loop as the daemon uses, an asyncpg pool, "
            "enqueue batches of the same size as pgqueuer's in one statement, terminal writes "
            "of runs ending together in one statement, hints after commit, young-table "
            "statistics kept fresh). Both count jobs done over the time from the consumers' "
            "start to their stop.",
            "The client and PostgreSQL share the machine's cores; client_cpu_s and "
            "postgres_cpu_s show where the time went, loadavg_1m_before_after how busy the "
            "machine was. backlog_kept false: the queue ran dry, so the figure is bounded by "
            "the enqueuers; the drain part measures the consumers alone.",
        ],
        "command": _command_line(),
        "seconds": round(time.monotonic() - started, 1),
    }
    out_dir = BENCH / "results" / ("quick" if args.quick else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "peer.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
