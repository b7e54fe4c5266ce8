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

from tests.support.daemon import Daemon, SpawnDaemon
from tests.support.factories import Device, new_device

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
    return await new_device(pool, "team", "desk")


@pytest.fixture
async def laptop(pool: asyncpg.Pool) -> Device:
    return await new_device(pool, "team", "laptop")
