"""The local TUI's config, which `agentd serve` writes on its first embedded start: a token that
works, and a file that cannot be written or read never stops the daemon nor leaves a working
token that no config holds."""

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
    """Devices whose token works."""
    count: int = await pool.fetchval("SELECT count(*) FROM device WHERE revoked_at IS NULL")
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
    assert await devices(pool) == 0, "a token works that no config holds"
    assert any("agenttui login" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("text", [
    "url = [unclosed\n",  # not TOML
    'url = "http://127.0.0.1:abc"\ntoken = "agd_x"\n',  # a port that is no number
    'url = "http://[::1"\ntoken = "agd_x"\n',  # an address that does not parse
], ids=["not TOML", "bad port", "bad address"])
async def test_a_config_it_cannot_read_is_left_alone(
        pool: asyncpg.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, text: str) -> None:
    config = tmp_path / "agenttui" / "config.toml"
    config.parent.mkdir()
    config.write_text(text, "utf-8")
    monkeypatch.setenv("AGENTTUI_CONFIG_DIR", str(config.parent))
    with caplog.at_level(logging.WARNING, logger="agentd.startup"):
        await ensure_local_client(pool, URL)
    assert config.read_text("utf-8") == text
    assert await devices(pool) == 0
    assert any("agenttui login" in r.getMessage() for r in caplog.records)
