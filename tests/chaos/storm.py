"""A storm for the whole system: daemons killed, paused and cut off, PostgreSQL restarted, while
scripted clients post turns, stop conversations and drop and resume their streams at random.

The checker then reads the database and every client transcript and counts violations of the
promises; every failure column must be zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from agentd.embedded_pg import EmbeddedPostgres
from tests.support.daemon import Daemon, poll_until, settings_env
from tests.support.sse import iter_sse

STREAM_TIMEOUT = httpx.Timeout(connect=2.0, read=4.0, write=4.0, pool=4.0)


LONG_TURN_FACTOR = 20  # a turn a stop will aim at: 200-1,200 tokens, about 0.4-14 s


@dataclass(frozen=True)
class StormConfig:
    runs: int = 150
    conversations: int = 25
    daemons: int = 3
    clients: int = 10
    seed: int = 20261129
    disconnect_p: float = 0.06  # per received event
    stop_p: float = 0.1  # per posted turn
    double_post_p: float = 0.3  # post a second turn right behind the first
    tokens: tuple[int, int] = (10, 60)
    delay_ms: tuple[int, int] = (2, 12)
    daemon_settings: dict[str, Any] = field(default_factory=lambda: {
        "lease_ttl_s": 3, "heartbeat_s": 1, "reap_interval_s": 0.5, "reap_grace_s": 0,
        "tick_s": 1, "max_runs": 8, "drain_s": 2, "log_level": "warning"})


@dataclass
class ClientRecord:
    """What one client saw of one run: text rebuilt from deltas and how it got there."""

    run_id: str
    conversation_id: str
    text: list[str] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    seq_errors: int = 0
    completes: int = 0
    status: str | None = None
    reconnects: int = 0


@dataclass
class StopRecord:
    conversation_id: str
    before: datetime
    after: datetime


@dataclass
class StormLog:
    records: dict[str, ClientRecord] = field(default_factory=dict)
    stops: list[StopRecord] = field(default_factory=list)
    actions: Counter[str] = field(default_factory=Counter)
    posted: int = 0
    errors: Counter[str] = field(default_factory=Counter)


class Fleet:
    """The daemons of the storm; a killed one is replaced so the fleet stays its size."""

    def __init__(self, dsn: str, workdir: Path, size: int, settings: dict[str, Any]) -> None:
        self.dsn = dsn
        self.workdir = workdir
        self.settings = settings
        self.daemons: list[Daemon] = []
        self.paused: set[str] = set()
        self._made = 0
        self.size = size

    async def start(self) -> None:
        for _ in range(self.size):
            await self.spawn()

    async def spawn(self) -> Daemon:
        self._made += 1
        daemon = Daemon(dsn=self.dsn, workdir=self.workdir / f"d{self._made}",
                        name=f"agentd-{self._made}", env=settings_env(**self.settings))
        daemon.workdir.mkdir(parents=True, exist_ok=True)
        daemon.start()
        await daemon.wait_ready(60)
        self.daemons.append(daemon)
        return daemon

    def urls(self) -> list[str]:
        live = [d.url for d in self.daemons if d.running and d.name not in self.paused]
        return live or [d.url for d in self.daemons]

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.close()

    def logs(self) -> str:
        return "\n".join(f"--- {d.name}\n{d.log_tail(4000)}" for d in self.daemons)


async def _db_now(pool: asyncpg.Pool) -> datetime:
    for _ in range(100):
        with contextlib.suppress(Exception):  # the server may be restarting right now
            return await pool.fetchval("SELECT clock_timestamp()")
        await asyncio.sleep(0.1)
    raise RuntimeError("database clock unreachable")


class Client:
    """A scripted device: posts turns, follows them with random disconnects, sometimes stops."""

    def __init__(self, name: str, token: str, fleet: Fleet, pool: asyncpg.Pool,
                 log: StormLog, config: StormConfig, rng: random.Random) -> None:
        self.name = name
        self.headers = {"Authorization": f"Bearer {token}"}
        self.fleet = fleet
        self.pool = pool
        self.log = log
        self.config = config
        self.rng = rng

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Retry across daemons until one answers below 500 (PostgreSQL may be restarting)."""
        last: Exception | None = None
        for attempt in range(200):
            url = self.rng.choice(self.fleet.urls())
            try:
                async with httpx.AsyncClient(base_url=url, headers=self.headers,
                                             timeout=STREAM_TIMEOUT) as http:
                    response = await http.request(method, path, **kwargs)
                if response.status_code < 500:
                    return response
                self.log.errors[f"http {response.status_code}"] += 1
            except httpx.HTTPError as exc:
                last = exc
                self.log.errors[type(exc).__name__] += 1
            await asyncio.sleep(min(0.05 * (attempt + 1), 0.5))
        raise RuntimeError(f"{method} {path} never succeeded: {last}")

    async def turn(self, conversation_id: str) -> None:
        cfg = self.config
        # A turn about to be stopped is made long enough (a second or more) for the stop to
        # find it running: the storm must stop live turns, not only ones that just ended.
        stopping = self.rng.random() < cfg.stop_p
        runs = [await self.post(conversation_id, long=stopping)]
        if self.rng.random() < cfg.double_post_p:
            runs.append(await self.post(conversation_id))
        stopper = None
        if stopping:
            stopper = asyncio.create_task(self.stop_later(conversation_id))
        for run_id in runs:
            await self.follow(run_id, conversation_id)
        if stopper is not None:
            await stopper

    async def post(self, conversation_id: str, *, long: bool = False) -> str:
        cfg = self.config
        tokens = self.rng.randint(*cfg.tokens) * (LONG_TURN_FACTOR if long else 1)
        body = {"content": f"{self.name} asks #{uuid.uuid4().hex[:8]}",
                "params": {"tokens": tokens, "delay_ms": self.rng.randint(*cfg.delay_ms)}}
        key = uuid.uuid4().hex  # a retried POST must not mint a second run
        response = await self.request("POST", f"/v1/conversations/{conversation_id}/runs",
                                      json=body, headers={"Idempotency-Key": key})
        assert response.status_code == 202, response.text
        run_id = response.json()["run_id"]
        self.log.records[run_id] = ClientRecord(run_id, conversation_id)
        self.log.posted += 1
        return run_id

    async def stop_later(self, conversation_id: str) -> None:
        await asyncio.sleep(self.rng.uniform(0, 0.1))
        before = await _db_now(self.pool)
        response = await self.request("POST", f"/v1/conversations/{conversation_id}/stop")
        after = await _db_now(self.pool)
        assert response.status_code == 202, response.text
        self.log.stops.append(StopRecord(conversation_id, before, after))
        self.log.actions["client stops"] += 1
        swept = response.json()
        self.log.actions["stopped turns"] += len(swept["cancelled"]) + len(swept["flagged"])

    async def follow(self, run_id: str, conversation_id: str) -> None:
        record = self.log.records[run_id]
        last = 0
        deadline = time.monotonic() + 180
        while record.status is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} never completed for {self.name}")
            url = self.rng.choice(self.fleet.urls())
            try:
                async with httpx.AsyncClient(base_url=url, headers=self.headers,
                                             timeout=STREAM_TIMEOUT) as http, \
                        http.stream("GET", f"/v1/runs/{run_id}/events",
                                    headers={"Last-Event-ID": str(last)}) as response:
                    if response.status_code >= 500:
                        raise httpx.HTTPError(f"status {response.status_code}")
                    assert response.status_code == 200, await response.aread()
                    async for event in iter_sse(response):
                        assert event.id is not None, event
                        seq = int(event.id)
                        if seq != last + 1:
                            record.seq_errors += 1
                        last = seq
                        record.seqs.append(seq)
                        data = event.data
                        if data["type"] == "content_delta":
                            record.text.append(data["delta"])
                        elif data["type"] == "complete":
                            record.completes += 1
                            record.status = data["status"]
                            break
                        if self.rng.random() < self.config.disconnect_p:
                            self.log.actions["client disconnects"] += 1
                            break
            except (httpx.HTTPError, OSError) as exc:
                self.log.errors[type(exc).__name__] += 1
                await asyncio.sleep(0.05)
            if record.status is None:
                record.reconnects += 1


async def chaos(fleet: Fleet, server: EmbeddedPostgres, pool: asyncpg.Pool, log: StormLog,
                config: StormConfig, rng: random.Random) -> None:
    """Inflict each failure once, when the storm has posted a given share of its turns."""
    lease = float(config.daemon_settings["lease_ttl_s"])

    async def at(share: float) -> None:
        await poll_until(_ready(lambda: log.posted >= share * config.runs), 600, 0.05,
                         what=f"{share:.0%} of the turns posted")

    await at(0.15)
    victim = rng.choice([d for d in fleet.daemons if d.running])
    victim.kill()
    log.actions["kill -9"] += 1
    await fleet.spawn()

    await at(0.30)
    sleeper = rng.choice([d for d in fleet.daemons if d.running])
    fleet.paused.add(sleeper.name)
    sleeper.stop()
    log.actions["SIGSTOP past lease"] += 1
    await asyncio.sleep(lease * 2 + 1)  # the lease itself is the subject: let it pass
    sleeper.cont()
    fleet.paused.discard(sleeper.name)

    await at(0.50)
    await asyncio.to_thread(server.stop, "fast", force=True)
    await asyncio.to_thread(server.start)
    log.actions["postgres restart"] += 1

    await at(0.70)
    for _ in range(50):
        with contextlib.suppress(OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            killed = await pool.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'agentd-hub'")
            if killed:
                log.actions["hub backends terminated"] += int(killed)
                break
        await asyncio.sleep(0.2)


def _ready(predicate: Callable[[], bool]) -> Callable[[], Any]:
    async def check() -> bool:
        return predicate()
    return check


@dataclass
class Verdict:
    counts: dict[str, int]
    failures: dict[str, list[str]]

    def summary(self) -> str:
        ok = " ".join(f"{k}={v}" for k, v in self.counts.items())
        bad = " ".join(f"{k}={len(v)}" for k, v in self.failures.items())
        return f"chaos: {ok} | failures: {bad}"

    @property
    def clean(self) -> bool:
        return not any(self.failures.values())


async def check(pool: asyncpg.Pool, log: StormLog) -> Verdict:
    """Read the database and every client transcript; count violations of the promises."""
    runs = await pool.fetch("SELECT id, conversation_id, status, created_at, started_at, "
                            "finished_at FROM agent_run")
    events = await pool.fetch("SELECT run_id, seq, type, payload FROM run_event ORDER BY "
                              "run_id, seq")
    answer_rows = await pool.fetch(
        "SELECT run_id, content FROM message WHERE role = 'assistant' AND tool_calls IS NULL")
    answers = {r["run_id"]: r["content"] for r in answer_rows}
    answer_count = Counter(r["run_id"] for r in answer_rows)
    by_run: dict[uuid.UUID, list[asyncpg.Record]] = defaultdict(list)
    for e in events:
        by_run[e["run_id"]].append(e)
    failures: dict[str, list[str]] = {k: [] for k in (
        "non_terminal", "double_execution", "complete_not_once", "journal_gaps",
        "turn_overlap", "text_mismatch", "client_seq_errors", "started_after_stop",
        "unfollowed")}
    statuses = Counter(r["status"] for r in runs)
    for run in runs:
        rid, journal = run["id"], by_run[run["id"]]
        if run["status"] in ("queued", "running"):
            failures["non_terminal"].append(str(rid))
        if sum(e["type"] == "run_started" for e in journal) > 1:
            failures["double_execution"].append(str(rid))
        if sum(e["type"] == "complete" for e in journal) != 1:
            failures["complete_not_once"].append(str(rid))
        if [e["seq"] for e in journal] != list(range(1, len(journal) + 1)):
            failures["journal_gaps"].append(str(rid))
        record = log.records.get(str(rid))
        if record is None:
            failures["unfollowed"].append(str(rid))
            continue
        # The transcript keeps what every client saw, however the run ended (a reaped or
        # drained run's streamed text is stored as a `failed` answer); no text, no answer.
        stored = answers.get(rid, "")
        journaled = "".join(e["payload"]["delta"] for e in journal
                            if e["type"] == "content_delta")
        if "".join(record.text) != stored or stored != journaled \
                or record.status != run["status"] or record.completes != 1:
            client_text = "".join(record.text)
            at = next((i for i, (a, b) in enumerate(zip(client_text, stored, strict=False))
                       if a != b), min(len(client_text), len(stored)))
            failures["text_mismatch"].append(
                f"{rid}: client {record.status}/{record.completes} len {len(client_text)} "
                f"db {run['status']} len {len(stored)} journal len {len(journaled)} "
                f"answers {answer_count[rid]}; first difference at {at}: client "
                f"{client_text[at - 20:at + 40]!r} db {stored[at - 20:at + 40]!r} journal "
                f"{journaled[at - 20:at + 40]!r}; deltas "
                f"{[e['payload']['delta'][:12] for e in journal if e['type'] == 'content_delta']}"
                f" client deltas {[t[:12] for t in record.text]}")
        if record.seq_errors:
            failures["client_seq_errors"].append(str(rid))
    by_conversation: dict[uuid.UUID, list[asyncpg.Record]] = defaultdict(list)
    for run in runs:
        if run["started_at"] is not None:
            by_conversation[run["conversation_id"]].append(run)
    for conv_runs in by_conversation.values():
        conv_runs.sort(key=lambda r: r["started_at"])
        for a, b in itertools.pairwise(conv_runs):
            if a["finished_at"] is None or b["started_at"] < a["finished_at"]:
                failures["turn_overlap"].append(f"{a['id']}/{b['id']}")
    for stop in log.stops:
        for run in runs:
            if str(run["conversation_id"]) == stop.conversation_id \
                    and run["created_at"] < stop.before and run["started_at"] is not None \
                    and run["started_at"] > stop.after:
                failures["started_after_stop"].append(str(run["id"]))
    counts = {"runs": len(runs), "conversations": len({r["conversation_id"] for r in runs}),
              **{s: statuses.get(s, 0) for s in ("completed", "failed", "cancelled")},
              "journal_rows": len(events),
              "client_reconnects": sum(r.reconnects for r in log.records.values()),
              **{k.replace(" ", "_").replace("-", ""): v for k, v in log.actions.items()}}
    return Verdict(counts, failures)
