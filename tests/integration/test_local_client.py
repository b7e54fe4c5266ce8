"""The local TUI's config, which `agentd serve` writes on its first embedded start: a token that
works, and a file that cannot be written or read never stops the daemon nor leaves a token
minted for nobody."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import asyncpg
import pytest

from agentd.accounts import authenticate
from agentd.startup import ensure_local_client

URL = "http://127.0.0.1:8740"


async def devices(pool: asyncpg.Pool) -> int:
    count: int = await pool.fetchval("SELECT count(*) FROM device")
    return count


async def test_the_first_start_writes_a_token_that_works(
        pool: asyncpg.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTTUI_CONFIG_DIR", str(tmp_path / "agenttui"))
    await ensure_local_client(pool, URL)
    config = tomllib.loads((tmp_path / "agenttui" / "config.toml").read_text("utf-8"))
    assert config["url"] == URL
    assert await authenticate(pool, config["token"]) is not None
    await ensure_local_client(pool, URL)  # a second start keeps it
    assert await devices(pool) == 1


async def test_a_config_it_cannot_write_is_logged_and_mints_nothing(
        pool: asyncpg.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory", "utf-8")  # refused even to root, unlike a mode
    monkeypatch.setenv("AGENTTUI_CONFIG_DIR", str(blocker / "agenttui"))
    with caplog.at_level(logging.WARNING, logger="agentd.startup"):
        await ensure_local_client(pool, URL)
    assert await devices(pool) == 0, "a token was minted for a config never written"
    assert any("agenttui login" in r.getMessage() for r in caplog.records)


async def test_a_config_it_cannot_read_is_left_alone(
        pool: asyncpg.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    config = tmp_path / "agenttui" / "config.toml"
    config.parent.mkdir()
    config.write_text("url = [unclosed\n", "utf-8")
    monkeypatch.setenv("AGENTTUI_CONFIG_DIR", str(config.parent))
    with caplog.at_level(logging.WARNING, logger="agentd.startup"):
        await ensure_local_client(pool, URL)
    assert config.read_text("utf-8") == "url = [unclosed\n"
    assert await devices(pool) == 0
    assert any("agenttui login" in r.getMessage() for r in caplog.records)
