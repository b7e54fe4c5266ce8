"""Applies the numbered SQL migrations under sql/ exactly once each, in order.

An advisory lock serializes concurrent migrators (a fleet starting at once); each file commits
with its schema_migrations row, so a crash mid-way leaves a consistent, resumable state.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from agentd.queries import Q, sql_dir

log = logging.getLogger("agentd.migrate")

# Any fixed bigint works; it only has to be the same in every agentd process.
MIGRATION_LOCK_KEY = 0x61_67_65_6E_74_64  # "agentd"
_MIGRATION_FILE = re.compile(r"^(\d{3,})_[a-z0-9_]+\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


class MigrationError(RuntimeError):
    pass


def discover(directory: Path | None = None) -> list[Migration]:
    """Migrations in version order; a duplicate version is an error.

    Numbers may skip (a number reserved for a change still in review); what must never happen
    is applying them out of order, which `migrate` refuses.
    """
    directory = directory or sql_dir()
    found: list[Migration] = []
    for path in sorted(directory.glob("*.sql")):
        match = _MIGRATION_FILE.match(path.name)
        if match:
            found.append(Migration(int(match.group(1)), path.stem, path.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    for before, after in itertools.pairwise(found):
        if before.version == after.version:
            raise MigrationError(f"migrations {before.name} and {after.name} share version "
                                 f"{after.version}")
    return found


async def migrate(conn: asyncpg.Connection, directory: Path | None = None) -> list[str]:
    """Apply pending migrations; returns the names applied (empty when already current)."""
    migrations = discover(directory)
    applied: list[str] = []
    await conn.execute(Q.migration_session_unbounded.sql)
    if not await conn.fetchval(*Q.migration_try_lock.bind(key=MIGRATION_LOCK_KEY)):
        # Another process is migrating (or holds the lock): this start waits, and says why.
        log.info("waiting for another process's migration (the migration lock is held)")
        await conn.execute(*Q.migration_lock.bind(key=MIGRATION_LOCK_KEY))
    try:
        await conn.execute(Q.create_schema_migrations.sql)
        done = {r["version"]: r["checksum"] for r in
                await conn.fetch(Q.list_applied_migrations.sql)}
        for migration in migrations:
            if migration.version in done:
                if done[migration.version] != migration.checksum:
                    raise MigrationError(
                        f"migration {migration.name} changed after it was applied")
                continue
            if done and migration.version < max(done):
                # A later schema is already in place: this one was written against an older one.
                raise MigrationError(
                    f"migration {migration.name} is older than version {max(done)}, which is "
                    f"already applied: renumber it after {max(done)}")
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(
                    *Q.record_migration.bind(version=migration.version, name=migration.name,
                                             checksum=migration.checksum))
            applied.append(migration.name)
    finally:
        await conn.execute(*Q.migration_unlock.bind(key=MIGRATION_LOCK_KEY))
    return applied


async def pending(conn: asyncpg.Connection, directory: Path | None = None) -> list[str]:
    """Names of migrations not yet applied (for `agentd status` / `doctor`)."""
    exists = await conn.fetchval(Q.schema_migrations_exists.sql)
    done: set[int] = set()
    if exists:
        done = {r["version"] for r in await conn.fetch(Q.list_applied_migrations.sql)}
    return [m.name for m in discover(directory) if m.version not in done]
