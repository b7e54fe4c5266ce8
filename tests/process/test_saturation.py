"""Overload never kills a live turn: one daemon, hundreds of concurrent streaming turns, short
leases, an SSE client on every turn.

The daemon is pushed far past its comfort (every turn posted at once, max_runs above the number
of turns, a 3 s lease beaten every second, the pool's default size). Whatever it cannot keep
alive it must leave queued (admission by capacity), so: no turn ends `failed` with `lease_expired`
while its worker lives, every turn completes, and every client's text equals the stored answer.
Its own reaper runs every half second without grace, and so does one in this test process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any
from uuid import UUID

import httpx
from httpx_sse import aconnect_sse
from prometheus_client.parser import text_string_to_metric_families

from agentd.providers.demo import expected_answer
from agentd.queue import reap_expired
from tests.support.daemon import poll_until
from tests.support.factories import new_device
from tests.support.journal import assert_journal_sound

TURNS = 500
TOKENS = 300
DELAY_MS = 100  # 30 s of streaming per turn when the daemon keeps up
SETTINGS = {"lease_ttl_s": 3, "heartbeat_s": 1, "reap_interval_s": 0.5, "reap_grace_s": 0,
            "max_runs": TURNS + 100, "log_level": "warning",
            # one device follows every turn: let it hold them all open, and its account run
            # them all at once (the per-account limit is not what this test saturates)
            "streams_per_device": TURNS + 10, "account_max_running": TURNS + 100}
STREAM_TIMEOUT = httpx.Timeout(30.0, read=120.0)
DEADLINE_S = 600  # a loaded shared machine may stretch this; the test polls, never sleeps


class Reader:
    """One client following one run's stream to its `complete`, resuming by Last-Event-ID."""

    def __init__(self, client: httpx.AsyncClient, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.text: list[str] = []
        self.last = 0
        self.completes: list[dict[str, Any]] = []
        self.reconnects = 0

    async def follow(self) -> None:
        while not self.completes:
            try:
                async with aconnect_sse(self.client, "GET", f"/v1/runs/{self.run_id}/events",
                                        headers={"Last-Event-ID": str(self.last)},
                                        timeout=STREAM_TIMEOUT) as source:
                    assert source.response.status_code == 200
                    async for sse in source.aiter_sse():
                        if not sse.data:
                            continue
                        seq = int(sse.id)
                        assert seq == self.last + 1, f"{self.run_id}: seq {seq} after {self.last}"
                        self.last = seq
                        data = sse.json()
                        if sse.event == "content_delta":
                            self.text.append(data["delta"])
                        elif sse.event == "complete":
                            self.completes.append(data)
                            return
            except httpx.TransportError:
                self.reconnects += 1
                await asyncio.sleep(0.1)


async def test_saturated_daemon_keeps_every_live_turn_and_every_client_sees_the_answer(
        spawn_daemon, pool):
    daemon = spawn_daemon(name="saturated", **SETTINGS)
    await daemon.wait_ready()
    bench = await new_device(pool, "load", "bench")
    limits = httpx.Limits(max_connections=TURNS + 50, max_keepalive_connections=TURNS + 50)
    async with daemon.client(timeout=STREAM_TIMEOUT, limits=limits,
                             headers=bench.headers) as client:
        conversations = []
        for n in range(TURNS):
            made = await client.post("/v1/conversations", json={"title": f"load {n}"})
            assert made.status_code == 201, made.text
            conversations.append(made.json()["id"])
        contents = {}

        async def post(n: int) -> str:
            content = f"saturation turn {n}"
            made = await client.post(f"/v1/conversations/{conversations[n]}/runs", json={
                "content": content, "params": {"tokens": TOKENS, "delay_ms": DELAY_MS}})
            assert made.status_code == 202, made.text
            contents[made.json()["run_id"]] = content
            return made.json()["run_id"]

        started = time.monotonic()
        run_ids = await asyncio.gather(*(post(n) for n in range(TURNS)))
        readers = [Reader(client, run_id) for run_id in run_ids]
        following = [asyncio.create_task(r.follow()) for r in readers]
        peak = {"running": 0}
        stop_watching = asyncio.Event()

        async def watch() -> None:
            # The test's own reaper, and the peak of concurrently running turns.
            while not stop_watching.is_set():
                await reap_expired(pool, grace_s=0)
                running = await pool.fetchval(
                    "SELECT count(*) FROM agent_run WHERE status = 'running'")
                peak["running"] = max(peak["running"], running)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop_watching.wait(), 0.5)

        watcher = asyncio.create_task(watch())
        try:
            async def all_followed() -> bool:
                return all(task.done() for task in following)

            await poll_until(all_followed, DEADLINE_S, interval=0.5,
                             what=f"{TURNS} clients to see their turn's complete")
            for task in following:
                task.result()  # a client's assertion fails the test here
        finally:
            stop_watching.set()
            await watcher
            for task in following:
                task.cancel()
        elapsed = time.monotonic() - started
        scraped = (await client.get("/metrics")).text

    runs = await pool.fetch("SELECT id, status, error, error_code FROM agent_run")
    assert len(runs) == TURNS
    statuses = Counter(r["status"] for r in runs)
    assert [r["id"] for r in runs if r["error_code"] == "lease_expired"] == []
    assert statuses == {"completed": TURNS}, [(r["status"], r["error"]) for r in runs
                                              if r["status"] != "completed"][:5]
    assert daemon.running
    answers = {r["run_id"]: r for r in await pool.fetch(
        "SELECT run_id, id, content, status FROM message WHERE role = 'assistant'")}
    for reader in readers:
        run_id = UUID(reader.run_id)
        stored = answers[run_id]
        assert [c["status"] for c in reader.completes] == ["completed"]
        assert reader.completes[0]["message_id"] == str(stored["id"])
        assert "".join(reader.text) == stored["content"] == \
            expected_answer("demo", contents[reader.run_id], TOKENS)
        await assert_journal_sound(pool, run_id)

    families = {f.name: f for f in text_string_to_metric_families(scraped)}
    value = {s.name: s.value for f in families.values() for s in f.samples}
    beats = value["agentd_heartbeats_total"]
    print(f"\nsaturation: turns={TURNS} peak_running={peak['running']} "
          f"seconds={elapsed:.1f} beats={beats:.0f} beats_per_s={beats / elapsed:.2f} "
          f"leases_lost={value['agentd_leases_lost_total']:.0f} "
          f"holds={value['agentd_admission_holds_total']:.0f} "
          f"reconnects={sum(r.reconnects for r in readers)}")
    assert value["agentd_leases_lost_total"] == 0
    # Saturated for real: far more turns at once than the default max_runs of 16.
    assert peak["running"] >= 50, peak
