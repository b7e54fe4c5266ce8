"""Tool tests: a real daemon configured with real MCP servers (the PyPI `mcp-server-time`, and
tests/tools/mcp_server.py over stdio or streamable HTTP), driven over HTTP by two accounts.

The test server writes what it sees to a journal file, read here from outside the daemon.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.api.conftest import Api, started_api
from tests.support.daemon import free_port, poll_until
from tests.support.sse import read_sse

TEST_SERVER = Path(__file__).with_name("mcp_server.py")
MCP_SERVER_TIME = Path(sys.executable).with_name("mcp-server-time")


def toml_value(value: Any) -> str:
    """Strings, numbers, booleans, lists and inline tables: all the config files here need.
    (A JSON string is a valid TOML basic string for the text these tests write.)"""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(value)


def write_config(path: Path, servers: dict[str, dict[str, Any]],
                 tools: dict[str, str] | None = None) -> Path:
    lines = []
    if tools:
        lines.append("[tools]")
        lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in tools.items()]
    for name, spec in servers.items():
        lines.append(f"[mcp.{name}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in spec.items()]
    path.write_text("\n".join(lines) + "\n", "utf-8")
    return path


def mcp_test_server(journal: Path, **spec: Any) -> dict[str, Any]:
    """An `[mcp.<name>]` table for the test server over stdio, journaling to `journal`."""
    return {"command": sys.executable, "args": [str(TEST_SERVER)],
            "env": {"TEST_MCP_JOURNAL": str(journal)}, **spec}


def read_mcp_journal(journal: Path) -> list[dict[str, Any]]:
    if not journal.exists():
        return []
    return [json.loads(line) for line in journal.read_text("utf-8").splitlines() if line]


async def journaled(journal: Path, predicate: Callable[[dict[str, Any]], bool],
                    timeout: float = 30.0) -> dict[str, Any]:  # noqa: ASYNC109
    """The first journal entry matching `predicate`, polled for until the deadline."""

    async def found() -> dict[str, Any] | None:
        return next((e for e in read_mcp_journal(journal) if predicate(e)), None)

    return await poll_until(found, timeout, interval=0.05, what="a journal entry")


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    return tmp_path / "mcp-journal.jsonl"


@pytest.fixture
def start_tools_api(spawn_daemon, pool: asyncpg.Pool, tmp_path: Path):
    """`async with start_tools_api(servers, **settings) as api`: a daemon with that config."""

    @asynccontextmanager
    async def start(servers: dict[str, dict[str, Any]], *, tools: dict[str, str] | None = None,
                    env: dict[str, str] | None = None, **settings: Any) -> AsyncIterator[Api]:
        config = write_config(tmp_path / "agentd.toml", servers, tools)
        async with started_api(spawn_daemon, pool, args=["--config", str(config)],
                               env=env or {}, **settings) as api:
            yield api

    return start


@pytest.fixture
def http_test_server(journal: Path, tmp_path: Path) -> Iterator[str]:
    """The test server over streamable HTTP on a local port; yields its MCP endpoint URL."""
    port = free_port()
    log = open(tmp_path / "mcp-http.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, str(TEST_SERVER), "http", str(port)],
                            env={"TEST_MCP_JOURNAL": str(journal), "PATH": "/usr/bin:/bin"},
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        _wait_listening(proc, port)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()


def _wait_listening(proc: subprocess.Popen[bytes], port: int, timeout: float = 30.0) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the HTTP test server exited"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)  # blocking on purpose: a fixture's setup, before any test runs
    raise AssertionError("the HTTP test server did not listen in time")


async def run_events(client: httpx.AsyncClient, run_id: str) -> list[dict[str, Any]]:
    """The run's journal as a finished run's event stream returns it (data payloads)."""
    return [e.data for e in await read_sse(client, f"/v1/runs/{run_id}/events")]
