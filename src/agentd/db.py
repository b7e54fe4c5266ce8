"""Connection pool construction: codecs and the timeouts that keep every transaction short.

Claims and lease writes must never wait long on a lock (seed 000), so every pooled session gets
bounded lock and statement timeouts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import asyncpg


@dataclass(frozen=True, slots=True)
class DbTimeouts:
    lock_timeout_ms: int = 5_000
    statement_timeout_ms: int = 30_000
    idle_in_transaction_ms: int = 60_000


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", schema="pg_catalog", encoder=json.dumps,
                              decoder=json.loads, format="text")
    await conn.set_type_codec("json", schema="pg_catalog", encoder=json.dumps,
                              decoder=json.loads, format="text")


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """Release without a reset round trip (asyncpg's default sends UNLISTEN/RESET ALL/...).

    Nothing agentd runs on a pooled connection leaves session state behind: no SET, LISTEN,
    advisory lock or cursor outside a transaction (the hub and the migrator have their own
    connections). asyncpg still rolls back an open transaction and drops listeners on release.
    """


def server_settings(timeouts: DbTimeouts, application_name: str = "agentd") -> dict[str, str]:
    return {
        "application_name": application_name,
        "lock_timeout": str(timeouts.lock_timeout_ms),
        "statement_timeout": str(timeouts.statement_timeout_ms),
        "idle_in_transaction_session_timeout": str(timeouts.idle_in_transaction_ms),
    }


async def create_pool(dsn: str, *, min_size: int = 2, max_size: int = 20,
                      timeouts: DbTimeouts | None = None,
                      application_name: str = "agentd",
                      statement_cache_size: int = 100) -> asyncpg.Pool:
    """A pool whose sessions decode json/jsonb and carry bounded lock/statement timeouts."""
    settings = server_settings(timeouts or DbTimeouts(), application_name)
    return await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size, init=_init_connection,
        reset=_keep_session, server_settings=settings,
        statement_cache_size=statement_cache_size)


async def connect(dsn: str, *, application_name: str = "agentd",
                  **kwargs: Any) -> asyncpg.Connection:
    """A single connection with the same codecs as the pool (the hub's, migrations', tests')."""
    conn = await asyncpg.connect(
        dsn, server_settings={"application_name": application_name}, **kwargs)
    await _init_connection(conn)
    return conn
