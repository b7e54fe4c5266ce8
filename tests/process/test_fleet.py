"""A fleet of daemons, fair and bounded: per-account limits set with `agentd account set` hold
across daemons, a quiet account is not starved by a busy one, and `agentd status` shows it all.

Daemons are real processes on this test's database; the limits live in the database, so every
daemon enforces the same ones. Everything is observed through the database clock.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime
from uuid import UUID

import asyncpg

from agentd.accounts import account_limits
from agentd.queue import enqueue_run
from tests.process.test_cli import agentd
from tests.support.daemon import poll_until
from tests.support.factories import enqueue_demo, new_conversation

FAST = {"heartbeat_s": 0.5, "lease_ttl_s": 5, "tick_s": 0.5}


async def account_id(pool: asyncpg.Pool, name: str) -> UUID:
    return await pool.fetchval("SELECT id FROM account WHERE name = $1", name)


async def all_ended(pool: asyncpg.Pool, ids: list[UUID]) -> bool:
    return await pool.fetchval("SELECT count(*) FROM agent_run WHERE id = ANY($1)"
                               " AND status IN ('completed', 'failed', 'cancelled')",
                               ids) == len(ids)


def max_overlap(runs: list[asyncpg.Record]) -> int:
    """The most runs running at once, from their started_at/finished_at (database clock)."""
    edges = sorted([(r["started_at"], 1) for r in runs] + [(r["finished_at"], -1) for r in runs],
                   key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    level = peak = 0
    for _at, step in edges:
        level += step
        peak = max(peak, level)
    return peak


async def test_account_set_limits_that_two_daemons_never_exceed_together(spawn_daemon, dsn,
                                                                         pool):
    made = agentd("account", "set", "capped", "--dsn", dsn, "--max-running", "3",
                  "--max-queued", "50", "--models", "demo")
    assert made.returncode == 0, made.stderr
    assert "capped" in made.stdout and "demo" in made.stdout
    [limits] = await account_limits(pool, "capped")
    assert (limits.max_running, limits.max_queued, limits.models) == (3, 50, ("demo",))
    # Two slots each: the limit of 3 binds (4 could run), and only both together reach it.
    daemons = [spawn_daemon(name=n, max_runs=2, **FAST) for n in ("left", "right")]
    for daemon in daemons:
        await daemon.wait_ready()
    capped = await account_id(pool, "capped")
    turns = [await enqueue_demo(pool, capped, await new_conversation(pool, capped), f"t{n}",
                                tokens=4, delay_ms=60) for n in range(24)]
    ids = [t.run_id for t in turns]
    seen = 0

    async def done_within_limit() -> bool:
        nonlocal seen
        running = await pool.fetchval("SELECT count(*) FROM agent_run WHERE account_id = $1"
                                      " AND status = 'running'", capped)
        assert running <= 3, f"{running} turns of the account ran at once"
        seen = max(seen, running)
        return await all_ended(pool, ids)

    await poll_until(done_within_limit, 120, interval=0.01, what="every capped turn to end")
    runs = await pool.fetch("SELECT status, worker_id, started_at, finished_at FROM agent_run"
                            " WHERE id = ANY($1)", ids)
    assert {r["status"] for r in runs} == {"completed"}
    assert max_overlap(runs) == 3  # at the limit, never over it (exactly, by the DB clock)
    assert {r["worker_id"] for r in runs} == {d.worker_id for d in daemons}, \
        "both daemons took part"


async def test_a_quiet_account_starts_within_one_claim_cycle_of_a_busy_backlog(spawn_daemon,
                                                                              pool):
    daemons = [spawn_daemon(name=n, max_runs=3, **FAST) for n in ("left", "right")]
    for daemon in daemons:
        await daemon.wait_ready()
    agentd_accounts = {}
    for name in ("busy", "quiet", "third"):
        await pool.execute("INSERT INTO account (name) VALUES ($1)", name)
        agentd_accounts[name] = await account_id(pool, name)
    busy, quiet, third = agentd_accounts.values()
    backlog = [await enqueue_demo(pool, busy, await new_conversation(pool, busy), f"b{n}",
                                  tokens=3, delay_ms=100) for n in range(80)]

    async def saturated() -> bool:
        return await pool.fetchval("SELECT count(*) FROM agent_run WHERE account_id = $1"
                                   " AND status = 'running'", busy) == 6

    await poll_until(saturated, 30, what="both daemons busy with the backlog")
    late = await enqueue_demo(pool, quiet, await new_conversation(pool, quiet), "me too",
                              tokens=3, delay_ms=100)
    row = await poll_until(lambda: _started(pool, late.run_id), 30, interval=0.01,
                           what="the quiet account's turn to start")
    jumped = await pool.fetchval(
        "SELECT count(*) FROM agent_run WHERE account_id = $1 AND started_at > $2"
        " AND started_at < $3", busy, row["created_at"], row["started_at"])
    # Each daemon had at most one claim under way when it arrived; the next went to it.
    assert jumped <= len(daemons), f"{jumped} busy turns started ahead of the quiet one"

    # Three accounts with work: they share the claims evenly while all three wait.
    for name, account in (("quiet", quiet), ("third", third)):
        for n in range(12):
            await enqueue_demo(pool, account, await new_conversation(pool, account),
                               f"{name}{n}", tokens=3, delay_ms=100)
    mark = await pool.fetchval("SELECT clock_timestamp()")
    await poll_until(lambda: all_ended(pool, [t.run_id for t in backlog]), 120,
                     interval=0.2, what="the backlog to end")
    starts = await pool.fetch("SELECT account_id, started_at FROM agent_run"
                              " WHERE started_at > $1 ORDER BY started_at", mark)
    # While all three had turns waiting: the first 24 starts after the mark.
    window = Counter(r["account_id"] for r in starts[:24])
    assert min(window[a] for a in (busy, quiet, third)) >= 6, window


async def _started(pool: asyncpg.Pool, run_id: UUID) -> asyncpg.Record | None:
    row = await pool.fetchrow("SELECT created_at, started_at FROM agent_run WHERE id = $1",
                              run_id)
    return row if row["started_at"] is not None else None


async def test_status_shows_the_fleet_workers_queue_by_account_and_owners(spawn_daemon, dsn,
                                                                         pool):
    daemon = spawn_daemon(name="solo", max_runs=4, **FAST)
    await daemon.wait_ready()
    made = agentd("token", "create", "--dsn", dsn, "--account", "alpha", "--device", "laptop")
    assert made.returncode == 0, made.stderr
    assert agentd("account", "set", "alpha", "--dsn", dsn, "--max-running", "1").returncode == 0
    alpha = await account_id(pool, "alpha")
    device = await pool.fetchval("SELECT id FROM device WHERE name = 'laptop'")
    conversations = [await new_conversation(pool, alpha) for _ in range(2)]
    # Turns asked from the laptop, as the API would enqueue them.
    long = await enqueue_run(pool, account_id=alpha, conversation_id=conversations[0],
                             content="think", device_id=device,
                             request={"content": "think",
                                      "params": {"tokens": 400, "delay_ms": 100}})
    await enqueue_run(pool, account_id=alpha, conversation_id=conversations[1],
                      content="wait", device_id=device,
                      request={"content": "wait", "params": {"tokens": 2, "delay_ms": 0}})

    async def settled() -> dict | None:
        shown = agentd("status", "--dsn", dsn, "--json")
        assert shown.returncode == 0, shown.stderr
        body = json.loads(shown.stdout)
        workers = body["workers"]
        ok = body["running"] and workers and workers[0]["runs_in_flight"] == 1
        return body if ok else None

    body = await poll_until(settled, 30, interval=0.2, what="status to show the running turn")
    assert body["queue"] == {"queued": 1, "running": 1, "expired_leases": 0}
    [worker] = body["workers"]
    assert (worker["worker_id"], worker["pid"], worker["max_runs"], worker["claiming"]) == \
        (daemon.worker_id, daemon.pid, 4, True)
    assert worker["host"] == daemon.worker_id.split(":")[0]
    assert 0 <= worker["beat_age_s"] < 5 and worker["loop_lag_ms"] >= 0
    assert datetime.fromisoformat(worker["last_beat_at"].replace("Z", "+00:00"))
    assert body["accounts"] == [{"account": "alpha", "queued": 1, "running": 1,
                                 "max_running": 1, "max_queued": 1000}]
    [owner] = body["running"]
    assert (owner["run_id"], owner["conversation_id"], owner["account"], owner["device"],
            owner["worker_id"]) == (str(long.run_id), str(conversations[0]), "alpha",
                                    "laptop", daemon.worker_id)
    assert 0 < owner["lease_left_s"] <= FAST["lease_ttl_s"]
    text = agentd("status", "--dsn", dsn)
    assert text.returncode == 0, text.stderr
    for shown in ("live workers: 1", "alpha", "1/1", "laptop", str(conversations[0])):
        assert shown in text.stdout, (shown, text.stdout)
    await pool.execute("UPDATE agent_run SET cancel_requested = true WHERE id = $1",
                       long.run_id)  # let the daemon finish early: nothing more to see


def test_account_set_refuses_bad_limits_naming_the_key(tmp_path) -> None:
    for args, named in ((("--max-running", "-1"), "--max-running"),
                        (("--max-running", "100000"), "--max-running"),
                        (("--max-queued", "many"), "--max-queued"),
                        (("--models", "openai:*,,"), "--models"),
                        (("--models", "nosuch:*"), "nosuch"),
                        ((), "nothing to set")):
        # No database is reached: the options are checked first (a DSN nobody listens on).
        result = agentd("account", "set", "someone", "--dsn",
                        "postgresql://nobody@127.0.0.1:1/none", *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and named in lines[0], (args, result.stderr)
        assert "Traceback" not in result.stderr

