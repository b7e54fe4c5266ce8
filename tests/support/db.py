"""A real PostgreSQL, one fresh database per test cloned from a migrated template.

AGENTD_TEST_DSN points the suite at a server; without it the suite starts the same embedded
PostgreSQL the daemon uses, in a private temporary directory. Loaded as a plugin
(tests/conftest.py): `pg_admin_dsn`, `template_db`, `dsn`, `pool`, `hub` (a started LISTEN hub),
`notifier` (after-commit hints, sending) and `repo_root` are fixtures of every tier.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from agentd import db as dbmod
from agentd.hub import Hub
from agentd.migrate import migrate
from agentd.notifier import Notifier


def with_database(dsn: str, database: str) -> str:
    """The same server address with another database name."""
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


@contextmanager
def reachable_dir(prefix: str) -> Iterator[Path]:
    """A temporary folder every account can traverse, removed afterwards. For an embedded
    PostgreSQL's data: as root the server runs as an unprivileged account, which cannot enter
    pytest's 0700 base directory, so this is not under tmp_path."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    """A DSN with rights to create databases: the configured server or an embedded one."""
    configured = os.environ.get("AGENTD_TEST_DSN")
    if configured:
        yield configured
        return
    from agentd.embedded_pg import EmbeddedPostgres

    # The space in the name keeps the paths honest.
    with reachable_dir("agentd tests ") as root:
        server = EmbeddedPostgres(root, fast=True)
        try:
            server.start()
            yield server.dsn("postgres")
        finally:
            server.stop()


@pytest.fixture(scope="session")
def template_db(pg_admin_dsn: str) -> Iterator[str]:
    """A migrated template database; every test database is a cheap copy of it."""
    name = f"agentd_tpl_{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        admin = await asyncpg.connect(pg_admin_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        conn = await asyncpg.connect(with_database(pg_admin_dsn, name))
        try:
            await migrate(conn)
        finally:
            await conn.close()

    asyncio.run(create())
    try:
        yield name
    finally:
        asyncio.run(_drop_database(pg_admin_dsn, name))


async def _drop_database(admin_dsn: str, name: str) -> None:
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def dsn(pg_admin_dsn: str, template_db: str) -> AsyncIterator[str]:
    """A fresh, migrated database of this test's own."""
    name = f"agentd_t_{uuid.uuid4().hex[:16]}"
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    finally:
        await admin.close()
    try:
        yield with_database(pg_admin_dsn, name)
    finally:
        await _drop_database(pg_admin_dsn, name)


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await dbmod.create_pool(dsn, min_size=1, max_size=30)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def hub(dsn: str) -> AsyncIterator[Hub]:
    hub = Hub(dsn)
    await hub.start()
    assert hub.connected
    try:
        yield hub
    finally:
        await hub.close()


@pytest.fixture
async def notifier(pool: asyncpg.Pool) -> AsyncIterator[Notifier]:
    notifier = Notifier(pool)
    notifier.start()
    try:
        yield notifier
    finally:
        await notifier.close()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]
