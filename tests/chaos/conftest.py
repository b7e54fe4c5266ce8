"""The storm runs on a PostgreSQL of its own, because it restarts it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentd.embedded_pg import EmbeddedPostgres
from agentd.migrate import migrate
from tests.support.db import reachable_dir


@pytest.fixture
def storm_server() -> Iterator[tuple[EmbeddedPostgres, str]]:
    with reachable_dir("agentd storm ") as root:
        yield from _storm_server(root)


def _storm_server(root: Path) -> Iterator[tuple[EmbeddedPostgres, str]]:
    server = EmbeddedPostgres(root, fast=True, settings={"max_connections": "300"})
    try:
        server.start()

        async def prepare() -> None:
            import asyncpg

            admin = await asyncpg.connect(server.dsn("postgres"))
            try:
                await admin.execute("CREATE DATABASE storm")
            finally:
                await admin.close()
            conn = await asyncpg.connect(server.dsn("storm"))
            try:
                await migrate(conn)
            finally:
                await conn.close()

        asyncio.run(prepare())
        yield server, server.dsn("storm")
    finally:
        server.stop(force=True)
