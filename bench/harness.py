"""Shared machinery of the benchmarks: a throwaway database, real daemons, SSE clients, stats.

Every benchmark runs against real `agentd serve` processes and a real PostgreSQL (its own
embedded one by default, or a fresh database on the server named by --dsn / AGENTD_BENCH_DSN),
prints ONE JSON object on stdout and its progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, urlsplit, urlunsplit

import aiohttp
import asyncpg

from agentd import __version__ as agentd_version
from agentd import db as dbmod
from agentd.accounts import create_device_token
from agentd.conversations import create_conversation
from agentd.migrate import migrate

BENCH_DSN_ENV = "AGENTD_BENCH_DSN"
TERMINAL = ("completed", "failed", "cancelled")
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_STARTED = time.monotonic()


# -- output -----------------------------------------------------------------------------------

def progress(message: str) -> None:
    """One progress line on stderr (stdout carries only the result)."""
    print(f"[{time.monotonic() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def emit(result: Mapping[str, Any]) -> None:
    """The benchmark's one JSON object on stdout."""
    json.dump(result, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def figure(name: str, value: float | int | str | bool | None, unit: str = "", *,
           target: str | None = None, met: bool | None = None) -> dict[str, Any]:
    """A headline figure: what docs/benchmarks.md shows, next to its target if it has one."""
    if isinstance(value, float):
        value = round(value, 3)
    return {"figure": name, "value": value, "unit": unit, "target": target, "met": met}


def percentiles(values: Iterable[float], digits: int = 3) -> dict[str, Any]:
    """n, min, p50, p90, p99, max and mean (nearest-rank percentiles)."""
    data = sorted(values)
    if not data:
        return {"n": 0}

    def rank(p: float) -> float:
        return data[max(0, math.ceil(p / 100 * len(data)) - 1)]

    return {"n": len(data), "min": round(data[0], digits), "p50": round(rank(50), digits),
            "p90": round(rank(90), digits), "p99": round(rank(99), digits),
            "max": round(data[-1], digits), "mean": round(sum(data) / len(data), digits)}


def peak_concurrent(runs: Iterable[Mapping[str, Any]]) -> int:
    """The most runs running at once, from their started_at/finished_at."""
    runs = list(runs)
    edges = sorted([(r["started_at"].timestamp(), 1) for r in runs if r["started_at"]]
                   + [(r["finished_at"].timestamp(), -1) for r in runs if r["finished_at"]])
    peak = level = 0
    for _stamp, step in edges:
        level += step
        peak = max(peak, level)
    return peak


# -- arguments --------------------------------------------------------------------------------

def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dsn", default=os.environ.get(BENCH_DSN_ENV),
                        help="a PostgreSQL server to use (a role that may CREATE DATABASE); a "
                        "fresh database is created and dropped per run. Default: "
                        f"${BENCH_DSN_ENV}, else a throwaway embedded PostgreSQL")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--pg-fast", action="store_true",
                        help="embedded server without durability (fsync off): not the "
                        "product's settings, only to separate disk cost from CPU cost")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (daemon logs, server data)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning"),
                        help="the daemons' log level (default: info, as shipped)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a daemon setting (AGENTD_<KEY>), e.g. --set pool_max=40; repeatable")
    return parser


# Benchmarks load one account far past what one person would: its limits must not be what
# they measure (bench/fairness.py sets its own).
UNBOUNDED_ACCOUNT = {"account_max_running": 10_000, "account_max_queued": 1_000_000}


def daemon_settings(args: argparse.Namespace, **settings: Any) -> dict[str, Any]:
    """The benchmark's own daemon settings, then --log-level and every --set on top."""
    out: dict[str, Any] = {**UNBOUNDED_ACCOUNT, **settings, "log_level": args.log_level}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip().lower()] = value
    return out


def params_of(args: argparse.Namespace) -> dict[str, Any]:
    out = {k: v for k, v in vars(args).items() if k not in ("dsn", "keep")}
    out["server"] = "external" if args.dsn else "embedded"
    return out


# -- machine ----------------------------------------------------------------------------------

def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"agentd": agentd_version}
    for name in ("asyncpg", "aiohttp"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def fdatasync_ms(directory: Path, rounds: int = 100) -> dict[str, Any]:
    """Time to write 8 kB and fdatasync it in `directory`: the floor of one durable commit."""
    path = directory / "fdatasync-probe"
    block = os.urandom(8192)
    times = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for _ in range(rounds):
            before = time.perf_counter()
            os.pwrite(fd, block, 0)
            os.fdatasync(fd)
            times.append((time.perf_counter() - before) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    return percentiles(times)


async def machine_info(database: BenchDatabase) -> dict[str, Any]:
    dsn = database.dsn
    conn = await asyncpg.connect(dsn)
    try:
        server = await conn.fetchval("SHOW server_version")
        pg_settings = {row["name"]: row["setting"] for row in await conn.fetch(
            "SELECT name, setting FROM pg_settings WHERE name = ANY($1::text[])",
            ["fsync", "synchronous_commit", "max_connections", "shared_buffers",
             "full_page_writes"])}
    finally:
        await conn.close()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "cores": os.cpu_count(), "cpu": _cpu_model(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(), "postgresql": server,
        "postgresql_settings": pg_settings, "versions": _versions(),
        "loadavg_at_start": [round(x, 2) for x in load] if load else None,
        # Where the embedded server keeps its WAL; for --dsn, only this machine's disk.
        "disk_fdatasync_8k_ms": await asyncio.to_thread(fdatasync_ms, database.workdir),
    }


def raise_nofile() -> int:
    """Raise this process's open-file limit to its hard limit (each SSE client is a socket)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: [1] ppid, [11] utime, [12] stime, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """utime+stime of a process from /proc/<pid>/stat (with its reaped children's if asked)."""
    fields = _stat_fields(pid)
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / _CLK_TCK


def backend_cpu_seconds(server_pid: int | None, backend_pid: int) -> float | None:
    """utime+stime of one server process (a session's backend), or None unless it is a child
    of the embedded server `server_pid`: a pid a remote or containerized server reports names
    nothing, or something else, on this machine."""
    if server_pid is None:
        return None
    try:
        if int(_stat_fields(backend_pid)[1]) != server_pid:
            return None
        return cpu_seconds(backend_pid)
    except OSError:
        return None


def tree_rss_mb(root_pid: int) -> float:
    """Resident memory of a process and its live children (a supervisor and its workers)."""
    page = os.sysconf("SC_PAGE_SIZE")
    pids = [root_pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int(_stat_fields(int(entry.name))[1]) == root_pid:
                    pids.append(int(entry.name))
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
    return total / (1 << 20)


class PeakRss:
    """Samples tree_rss_mb(pid) every `every_s` in the background; `.peak` is the largest."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self.pid = pid
        self.every_s = every_s
        self.peak = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, tree_rss_mb(self.pid))
            await asyncio.sleep(self.every_s)

    def start(self) -> PeakRss:
        self._task = asyncio.get_running_loop().create_task(self._sample())
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        with contextlib.suppress(OSError):
            self.peak = max(self.peak, tree_rss_mb(self.pid))


def tree_cpu_seconds(root_pid: int) -> float:
    """CPU of a process, its reaped children, and its live children (the PostgreSQL server)."""
    total = cpu_seconds(root_pid, children=True)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(int(entry.name))
        except OSError:
            continue
        if int(fields[1]) == root_pid:
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- database ---------------------------------------------------------------------------------

def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + quote(database, safe=""),
                       parts.query, parts.fragment))


@dataclass
class BenchDatabase:
    """A fresh, migrated database; `server_pid` is known only for the embedded server."""

    admin_dsn: str
    dsn: str
    name: str
    workdir: Path
    server_pid: int | None = None
    _siblings: list[str] = field(default_factory=list)

    def unreachable_dsn(self) -> str:
        """A DSN on the same server naming a database that does not exist: no LISTEN possible."""
        return with_database(self.admin_dsn, f"{self.name}_no_such_database")

    async def fresh(self, label: str) -> BenchDatabase:
        """Another fresh, migrated database on the same server (dropped with the first)."""
        name = f"agentd_bench_{label}_{uuid.uuid4().hex[:8]}"
        await _create_database(self.admin_dsn, name)
        created = BenchDatabase(self.admin_dsn, with_database(self.admin_dsn, name), name,
                                self.workdir, self.server_pid)
        self._siblings.append(name)
        return created


async def _create_database(admin_dsn: str, name: str) -> None:
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')  # name is ours: a fixed prefix + hex
    finally:
        await admin.close()
    conn = await asyncpg.connect(with_database(admin_dsn, name))
    try:
        await migrate(conn)
    finally:
        await conn.close()


async def _drop_database(admin_dsn: str, name: str) -> None:
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def _make_workdir(label: str) -> Path:
    workdir = Path(tempfile.mkdtemp(prefix=f"agentd-bench-{label}-"))
    # As root the embedded server runs as an unprivileged account, which must reach this dir.
    workdir.chmod(0o755)
    return workdir


@contextlib.asynccontextmanager
async def bench_database(args: argparse.Namespace, label: str, *,
                         pg_settings: Mapping[str, str] | None = None,
                         ) -> AsyncIterator[BenchDatabase]:
    """The run's database: on --dsn's server, or on a throwaway embedded PostgreSQL (started
    with `pg_settings` on top of its own)."""
    workdir = _make_workdir(label)
    server = None
    try:
        if args.dsn:
            admin_dsn, server_pid = args.dsn, None
        else:
            from agentd.embedded_pg import EmbeddedPostgres

            progress("starting a throwaway embedded PostgreSQL")
            server = EmbeddedPostgres(workdir / "pg", fast=args.pg_fast, settings=pg_settings)
            await asyncio.to_thread(server.start)
            admin_dsn = server.dsn("postgres")
            pid_line = (server.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            server_pid = int(pid_line)
        name = f"agentd_bench_{label}_{uuid.uuid4().hex[:8]}"
        await _create_database(admin_dsn, name)
        database = BenchDatabase(admin_dsn, with_database(admin_dsn, name), name, workdir,
                                 server_pid)
        try:
            yield database
        finally:
            for db_name in [name, *database._siblings]:
                with contextlib.suppress(Exception):
                    await _drop_database(admin_dsn, db_name)
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)
        if args.keep:
            progress(f"kept the work directory {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


async def wal_fsyncs(dsn: str) -> int | None:
    """WAL fsyncs so far, cluster-wide (pg_stat_io from PostgreSQL 18, pg_stat_wal before).

    Backends publish their counters when a transaction ends or they exit (at most once a
    second while busy), so read this after the daemons stopped.
    """
    conn = await asyncpg.connect(dsn)
    try:
        with contextlib.suppress(asyncpg.PostgresError):
            return int(await conn.fetchval(
                "SELECT sum(fsyncs) FROM pg_stat_io WHERE object = 'wal'"))
        with contextlib.suppress(asyncpg.PostgresError):
            return int(await conn.fetchval("SELECT wal_sync FROM pg_stat_wal"))
        return None
    finally:
        await conn.close()


async def transactions(dsn: str) -> int:
    """Transactions committed or rolled back in this database so far (pg_stat_database).

    Every statement a daemon sends outside an explicit transaction is one; published like
    wal_fsyncs, so read it after the daemons stopped.
    """
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database "
            "WHERE datname = current_database()"))
    finally:
        await conn.close()


async def clock_offset(dsn: str, samples: int = 20) -> float:
    """Seconds to add to this machine's time.time() to get the database clock.

    The sample with the shortest round trip wins; its error is at most half that round trip.
    """
    conn = await asyncpg.connect(dsn)
    try:
        best: tuple[float, float] | None = None
        for _ in range(samples):
            before = time.time()
            db_now = await conn.fetchval("SELECT clock_timestamp()")
            after = time.time()
            rtt = after - before
            offset = db_now.timestamp() - (before + after) / 2
            if best is None or rtt < best[0]:
                best = (rtt, offset)
        assert best is not None
        return best[1]
    finally:
        await conn.close()


async def open_pool(dsn: str, max_size: int = 5) -> asyncpg.Pool:
    """A pool with agentd's codecs, for setup writes and result reads."""
    return await dbmod.create_pool(dsn, min_size=1, max_size=max_size,
                                   application_name="agentd-bench")


async def make_account(pool: asyncpg.Pool, account: str = "bench",
                       device: str = "bench-client") -> tuple[str, uuid.UUID]:
    """A device token (for the HTTP API) and its account id."""
    token, _device_id = await create_device_token(pool, account=account, device=device)
    account_id = await pool.fetchval("SELECT id FROM account WHERE name = $1", account)
    return token, account_id


async def make_conversations(pool: asyncpg.Pool, account_id: uuid.UUID, count: int,
                             title: str = "bench") -> list[uuid.UUID]:
    """`count` conversations of the account, created in one transaction."""
    async with pool.acquire() as conn, conn.transaction():
        return [(await create_conversation(conn, account_id, f"{title} {i}")).id
                for i in range(count)]


async def wait_terminal(pool: asyncpg.Pool, run_ids: Sequence[uuid.UUID], *,
                        within_s: float, interval: float = 0.01) -> str:
    """Poll the rows until every run is terminal; returns the last run's status."""
    deadline = time.monotonic() + within_s
    while True:
        rows = await pool.fetch("SELECT status FROM agent_run WHERE id = ANY($1::uuid[])",
                                list(run_ids))
        statuses = [r["status"] for r in rows]
        if len(statuses) == len(run_ids) and all(s in TERMINAL for s in statuses):
            return statuses[-1]
        if time.monotonic() > deadline:
            raise TimeoutError(f"runs not terminal after {within_s:g}s: {statuses}")
        await asyncio.sleep(interval)


# -- daemons ----------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class BenchDaemon:
    """One `python -m agentd serve --dsn … --listen …` with AGENTD_* settings, logging to a file.

    The environment is isolated: no inherited AGENTD_* variables and private XDG dirs, so no
    user config file changes what is measured.
    """

    def __init__(self, dsn: str, workdir: Path, name: str = "agentd",
                 settings: Mapping[str, Any] | None = None) -> None:
        self.dsn = dsn
        self.name = name
        self.host = "127.0.0.1"
        self.port = free_port(self.host)
        self.workdir = workdir / name
        self.settings = dict(settings or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        return self.workdir / "agentd.log"

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
        for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
            path = self.workdir / var.lower()
            path.mkdir(parents=True, exist_ok=True)
            env[var] = str(path)
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("NOTIFY_SOCKET", None)
        env["AGENTD_WORKERS"] = "1"  # one process unless a benchmark sets `workers`
        env.update({f"AGENTD_{k.upper()}": str(v) for k, v in self.settings.items()})
        return env

    def start(self) -> BenchDaemon:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        command = [sys.executable, "-m", "agentd", "serve", "--dsn", self.dsn,
                   "--listen", f"{self.host}:{self.port}"]
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=self._environment(),
                                     cwd=self.workdir, start_new_session=True)
        return self

    async def wait_serving(self, *, need_hub: bool = True, within_s: float = 60.0) -> None:
        """Poll /readyz (or only /healthz when the hub is meant to be down) until it answers."""
        path = "/readyz" if need_hub else "/healthz"
        deadline = time.monotonic() + within_s
        async with aiohttp.ClientSession() as session:
            while True:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited before serving:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with session.get(self.url + path,
                                           timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        if resp.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not serving after {within_s:g}s:\n"
                                       f"{self.log_tail()}")
                await asyncio.sleep(0.05)

    def cpu_seconds(self) -> float:
        """The daemon's CPU, with its workers' when it runs several (`workers` setting)."""
        return tree_cpu_seconds(self.pid)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    async def stop(self, drain_s: float = 30.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after `drain_s`; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, drain_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return proc.returncode


@contextlib.asynccontextmanager
async def daemons(database: BenchDatabase, count: int = 1, *, need_hub: bool = True,
                  dsn: str | None = None, **settings: Any) -> AsyncIterator[list[BenchDaemon]]:
    """`count` daemons on the database (their pool through `dsn` when given: a pooler in front
    of it), serving; stopped (and killed if need be) on exit."""
    started = [BenchDaemon(dsn or database.dsn, database.workdir,
                           f"agentd-{uuid.uuid4().hex[:6]}", settings).start()
               for _ in range(count)]
    try:
        await asyncio.gather(*(d.wait_serving(need_hub=need_hub) for d in started))
        yield started
    finally:
        await asyncio.gather(*(d.stop() for d in started))


# -- HTTP and SSE clients ---------------------------------------------------------------------

def client_session(token: str, *, connections: int = 0) -> aiohttp.ClientSession:
    """An aiohttp session for the API: no connection cap (0) unless asked, no total timeout."""
    return aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {token}"},
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120),
        trust_env=False)


async def post_json(session: aiohttp.ClientSession, url: str,
                    body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    async with session.post(url, json=body if body is not None else {}) as resp:
        text = await resp.text()
        if resp.status >= 300:
            raise RuntimeError(f"POST {url}: {resp.status} {text}")
        return json.loads(text)


async def post_demo_runs(http: aiohttp.ClientSession, url: str,
                         conversations: Sequence[uuid.UUID], *, label: str,
                         params: Mapping[str, Any], concurrency: int,
                         on_posted: Callable[[str], None]) -> dict[str, str]:
    """POST one demo run per conversation, `concurrency` at a time; `on_posted(run_id)` runs
    right after each answer (to attach its clients at once). Returns run id -> its prompt."""
    gate = asyncio.Semaphore(concurrency)
    prompts: dict[str, str] = {}

    async def post(i: int, conversation: uuid.UUID) -> None:
        content = f"{label} {i}"
        async with gate:
            created = await post_json(http, f"{url}/v1/conversations/{conversation}/runs",
                                      {"content": content, "params": dict(params)})
        prompts[created["run_id"]] = content
        on_posted(created["run_id"])

    await asyncio.gather(*(post(i, c) for i, c in enumerate(conversations)))
    return prompts


@dataclass(frozen=True, slots=True)
class SseEvent:
    id: str | None
    event: str
    data: dict[str, Any]
    received: float  # time.time() when the frame was complete at the client
    received_mono: float  # time.monotonic() at the same moment


async def _lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body's lines, however long (a coalesced delta can exceed aiohttp's line limit)."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line


async def sse_stream(resp: aiohttp.ClientResponse) -> AsyncIterator[SseEvent]:
    """Parse an SSE response; keepalive comments are skipped."""
    event_id: str | None = None
    event = "message"
    data: list[str] = []
    async for raw in _lines(resp):
        line = raw.decode("utf-8").rstrip("\r")
        if not line:
            if data:
                yield SseEvent(event_id, event, json.loads("\n".join(data)), time.time(),
                               time.monotonic())
            event_id, event, data = None, "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id":
            event_id = value
        elif name == "event":
            event = value
        elif name == "data":
            data.append(value)
