"""API tests: a real `agentd serve` on this test's database, driven over HTTP by two accounts.

Account A (alice) owns the objects; account B (bob) is the stranger whose every look at them must
be a 404 that changes nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import asyncpg
import httpx
import pytest

from agentd.accounts import create_device_token
from tests.support.daemon import Daemon

READY_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 30.0
NO_PROVIDER_KEYS = {"OPENAI_API_KEY": "", "ANTHROPIC_API_KEY": ""}


@dataclass
class Api:
    """A ready daemon, the test's pool, and one HTTP client per account."""

    daemon: Daemon
    pool: asyncpg.Pool
    token_a: str
    token_b: str
    device_a: UUID
    device_b: UUID
    a: httpx.AsyncClient
    b: httpx.AsyncClient

    @property
    def url(self) -> str:
        return self.daemon.url

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.AsyncClient:
        """A client of this daemon sending `token` as its bearer (none if None)."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return self.daemon.client(timeout=HTTP_TIMEOUT_S, headers=headers, **kwargs)


@asynccontextmanager
async def started_api(spawn, pool: asyncpg.Pool, *, env: dict[str, str] | None = None,
                      **settings: Any) -> AsyncIterator[Api]:
    """Start a daemon with `settings`, wait until it is ready, mint tokens for A and B.

    The providers' key variables are blank unless `env` sets them: which models are usable must
    not depend on the machine running the tests.
    """
    daemon = spawn(env={**NO_PROVIDER_KEYS, **(env or {})}, **settings)
    await daemon.wait_ready(timeout=READY_TIMEOUT_S)
    token_a, device_a = await create_device_token(pool, account="alice", device="laptop")
    token_b, device_b = await create_device_token(pool, account="bob", device="phone")
    headers_a = {"Authorization": f"Bearer {token_a}"}
    headers_b = {"Authorization": f"Bearer {token_b}"}
    async with daemon.client(timeout=HTTP_TIMEOUT_S, headers=headers_a) as a, \
            daemon.client(timeout=HTTP_TIMEOUT_S, headers=headers_b) as b:
        yield Api(daemon, pool, token_a, token_b, device_a, device_b, a, b)


@pytest.fixture
async def api(spawn_daemon, pool: asyncpg.Pool) -> AsyncIterator[Api]:
    """A started daemon on this test's database and two accounts' clients."""
    async with started_api(spawn_daemon, pool) as ready:
        yield ready
