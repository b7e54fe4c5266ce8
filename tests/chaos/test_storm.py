"""The storm: 3 daemons, scripted clients, and every failure the design claims to survive.

`pytest tests/chaos --chaos-runs 500 --chaos-conversations 50 -s` for a long soak; the default
is small enough for CI. `--chaos-workers 2` makes each daemon a supervisor with two workers
(a kill -9 or a pause then takes the whole daemon: supervisor and workers). The summary line
is printed either way.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from agentd import db as dbmod
from agentd.accounts import create_device_token
from agentd.conversations import create_conversation
from agentd.embedded_pg import EmbeddedPostgres
from tests.chaos.storm import Client, Fleet, StormConfig, StormLog, chaos, check
from tests.support.daemon import poll_until


async def test_storm_breaks_no_promise(storm_server: tuple[EmbeddedPostgres, str],
                                       tmp_path_factory: pytest.TempPathFactory,
                                       request: pytest.FixtureRequest) -> None:
    server, dsn = storm_server
    config = StormConfig(runs=request.config.getoption("--chaos-runs"),
                         conversations=request.config.getoption("--chaos-conversations"))
    config.daemon_settings["workers"] = request.config.getoption("--chaos-workers")
    rng = random.Random(config.seed)
    log = StormLog()
    workdir = Path(tmp_path_factory.mktemp("storm"))
    pool = await dbmod.create_pool(dsn, min_size=1, max_size=4)
    fleet = Fleet(dsn, workdir, config.daemons, config.daemon_settings)
    request.node._agentd_daemons = fleet.daemons  # logs attached to a failure report
    try:
        tokens = [(await create_device_token(pool, account="storm", device=f"device-{i}"))[0]
                  for i in range(config.clients)]
        account_id = await pool.fetchval("SELECT id FROM account WHERE name = 'storm'")
        conversations = [str((await create_conversation(pool, account_id, f"c{i}")).id)
                         for i in range(config.conversations)]
        await fleet.start()
        clients = [Client(f"client-{i}", tokens[i], fleet, pool, log, config,
                          random.Random(rng.random())) for i in range(config.clients)]
        budget = {"left": config.runs}

        async def drive(client: Client) -> None:
            while budget["left"] > 0:
                budget["left"] -= 1
                await client.turn(client.rng.choice(conversations))

        havoc = asyncio.create_task(chaos(fleet, server, pool, log, config, rng))
        await asyncio.gather(*(drive(c) for c in clients))
        await havoc

        async def settled() -> bool:
            return not await pool.fetchval(
                "SELECT count(*) FROM agent_run WHERE status IN ('queued', 'running')")

        await poll_until(settled, 120, 0.2, what="every run terminal")
        verdict = await check(pool, log)
        print("\n" + verdict.summary())
        for name, items in verdict.failures.items():
            for item in items[:5]:
                print(f"  {name}: {item}")
        assert verdict.counts["runs"] >= config.runs
        assert all(verdict.counts.get(k, 0) >= 1 for k in (
            "kill_9", "SIGSTOP_past_lease", "postgres_restart", "hub_backends_terminated")), \
            verdict.counts
        assert verdict.counts.get("stopped_turns", 0) >= 1, "no stop ever hit a live turn"
        assert verdict.clean, {k: v[:5] for k, v in verdict.failures.items() if v}
    finally:
        fleet.close()
        await pool.close()
