"""TUI and client tests: real `agentd serve` daemons on this test's database, demo model.

Every test gets private agenttui config/cache/state directories, so nothing touches (or reads)
the user's own config, and device tokens minted on the test database for named devices.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from agentd.accounts import create_device_token
from tests.daemon_harness import Daemon, SpawnDaemon, pytest_runtest_makereport, spawn_daemon
from tests.tui.helpers import Device

__all__ = ["pytest_runtest_makereport", "spawn_daemon"]

READY_TIMEOUT_S = 60.0  # other suites share this machine's two cores


@pytest.fixture(autouse=True)
def agenttui_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Private agenttui directories, and no AGENTTUI_* setting inherited from the shell."""
    for key in list(os.environ):
        if key.startswith("AGENTTUI_"):
            monkeypatch.delenv(key)
    root = tmp_path / "agenttui"
    for name in ("config", "cache", "state"):
        (root / name).mkdir(parents=True)
        monkeypatch.setenv(f"AGENTTUI_{name.upper()}_DIR", str(root / name))
    yield root


@pytest.fixture
async def daemon(spawn_daemon: SpawnDaemon) -> Daemon:
    started = spawn_daemon()
    await started.wait_ready(timeout=READY_TIMEOUT_S)
    return started


@pytest.fixture
async def desk(pool: asyncpg.Pool) -> Device:
    token, device_id = await create_device_token(pool, account="team", device="desk")
    return Device("desk", token, str(device_id))


@pytest.fixture
async def laptop(pool: asyncpg.Pool) -> Device:
    token, device_id = await create_device_token(pool, account="team", device="laptop")
    return Device("laptop", token, str(device_id))
