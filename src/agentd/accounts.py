"""Accounts, their limits (running, queued, models) and device credentials: bearer tokens are
minted here and stored only as hashes."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from agentd.db import acquire, fetch_one
from agentd.queries import Q
from agentd.queue import Db
from agentd.settings import MAX_ACCOUNT_QUEUED, MAX_ACCOUNT_RUNNING

TOKEN_PREFIX = "agd_"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: resolved from a bearer token before anything else is touched."""

    account_id: UUID
    account_name: str
    device_id: UUID
    device_name: str
    models: tuple[str, ...] | None = None  # the account's model patterns; None: every model


@dataclass(frozen=True, slots=True)
class AccountLimits:
    """An account's limits (None: the fleet's default) and its turns right now."""

    id: UUID
    name: str
    max_running: int | None
    max_queued: int | None
    models: tuple[str, ...] | None
    queued: int
    running: int
    last_claimed_at: datetime | None


@dataclass(frozen=True, slots=True)
class LimitChange:
    """What `agentd account set` changes: only the limits whose `change_*` is set, each to its
    value (None: back to the fleet's default)."""

    change_running: bool = False
    max_running: int | None = None
    change_queued: bool = False
    max_queued: int | None = None
    change_models: bool = False
    models: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    id: UUID
    account: str
    name: str
    created_at: datetime
    last_seen_at: datetime | None
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class Revocation:
    """A device's revocation: when it landed, and whether an earlier request had landed it."""

    revoked_at: datetime
    again: bool


MAX_NAME_CHARS = 200  # the account and device tables' CHECK constraints


def check_name(what: str, name: str) -> str:
    """A name the account or device tables accept; ValueError names what is wrong with it.

    Checked before any statement runs, so a command line answers with the rule instead of the
    database's constraint violation.
    """
    if not name.strip():
        raise ValueError(f"{what} must not be empty")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"{what} must be at most {MAX_NAME_CHARS} characters, got {len(name)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError(f"{what} must not contain control characters, got {name!r}")
    return name


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


async def ensure_account(db: Db, name: str) -> UUID:
    account_id: UUID = (await fetch_one(db, *Q.ensure_account.bind(name=name)))["id"]
    return account_id


async def create_device_token(db: Db, *, account: str, device: str) -> tuple[str, UUID]:
    """Mint a token for a new device of `account` (created if missing); returns (token, id)."""
    account_id = await ensure_account(db, account)
    token = new_token()
    row = await fetch_one(db, *Q.create_device.bind(account_id=account_id, name=device,
                                                    token_hash=hash_token(token)))
    return token, row["id"]


async def authenticate(db: Db, token: str) -> Principal | None:
    """The principal a bearer token names, or None (unknown or revoked)."""
    digest = hash_token(token)
    row = await db.fetchrow(*Q.authenticate_device.bind(token_hash=digest))
    if row is None:
        # Same work on the miss path, so timing says nothing about near-miss tokens.
        hmac.compare_digest(digest, digest)
        return None
    models = row["models"]
    return Principal(row["account_id"], row["account_name"], row["device_id"],
                     row["device_name"], tuple(models) if models is not None else None)


async def list_devices(db: Db) -> list[DeviceInfo]:
    return [DeviceInfo(r["id"], r["account"], r["name"], r["created_at"], r["last_seen_at"],
                       r["revoked_at"]) for r in await db.fetch(Q.list_devices.sql)]


async def revoke_device(db: Db, device_id: UUID, *,
                        account_id: UUID | None = None) -> Revocation | None:
    """Revoke a device (of `account_id` only, when given); None if there is no such device.

    Its presence goes at once and its open streams end (agentd.revocation). A device revoked
    before is answered with its first revocation (`again`): a retry whose first answer was lost
    learns that it landed, instead of "not found".
    """
    revoked_at = await db.fetchval(*Q.revoke_device.bind(device_id=device_id,
                                                         account_id=account_id))
    if revoked_at is not None:
        return Revocation(revoked_at, again=False)
    revoked_at = await db.fetchval(*Q.device_revoked_at.bind(device_id=device_id,
                                                             account_id=account_id))
    return Revocation(revoked_at, again=True) if revoked_at is not None else None


async def account_devices(db: Db, account_id: UUID) -> list[DeviceInfo]:
    """The devices of one account (the account name is left empty: the caller knows it)."""
    return [DeviceInfo(r["id"], "", r["name"], r["created_at"], r["last_seen_at"],
                       r["revoked_at"])
            for r in await db.fetch(*Q.list_account_devices.bind(account_id=account_id))]


# pairing codes ---------------------------------------------------------------------------------


async def store_pairing(db: Db, *, code_hash: bytes, account_id: UUID, device_name: str | None,
                        created_by: UUID | None, ttl_s: float, max_open: int) -> datetime | None:
    """Keep a one-time code's hash until its deadline (database clock); returns the deadline,
    or None when the account already holds `max_open` codes neither spent nor expired."""
    async with acquire(db) as conn, conn.transaction():
        await conn.execute(*Q.lock_account_pairings.bind(account_id=account_id))
        expires_at: datetime | None = await conn.fetchval(*Q.create_pairing.bind(
            code_hash=code_hash, account_id=account_id, device_name=device_name,
            created_by=created_by, ttl_s=ttl_s, max_open=max_open))
    return expires_at


async def redeem_pairing(db: Db, *, code_hash: bytes, device_name: str,
                         token_hash: bytes) -> Principal | None:
    """Spend a code and create its device in one statement; None: unknown, spent or expired."""
    row = await db.fetchrow(*Q.redeem_pairing.bind(
        code_hash=code_hash, device_name=device_name, token_hash=token_hash))
    if row is None:
        return None
    return Principal(row["account_id"], row["account_name"], row["device_id"],
                     row["device_name"])


async def purge_pairings(db: Db, *, older_than_s: float) -> int:
    status = await db.execute(*Q.purge_pairings.bind(older_than_s=older_than_s))
    return int(status.split()[-1])


async def revoked_devices_among(db: Db, device_ids: list[UUID]) -> set[UUID]:
    """Which of these devices may no longer stream (revoked, or gone with their account)."""
    rows = await db.fetch(*Q.revoked_devices_among.bind(device_ids=device_ids))
    return {row["id"] for row in rows}


# limits ----------------------------------------------------------------------------------------

RESET = "default"  # `--max-running default`: back to the fleet's default
ALL_MODELS = ("*", "all")  # `--models all`: every model (the default)
_PATTERN = re.compile(r"^[A-Za-z0-9._\-*?\[\]!/]+(:[A-Za-z0-9._\-*?\[\]!/:@+]+)?$")
MAX_PATTERNS = 100


def parse_limit_change(*, max_running: str | None, max_queued: str | None,
                       models: str | None, providers: Iterable[str]) -> LimitChange:
    """`agentd account set`'s options as a LimitChange; ValueError names the bad one."""
    change = LimitChange()
    if max_running is not None:
        change = dataclasses.replace(change, change_running=True, max_running=_limit(
            "--max-running", max_running, MAX_ACCOUNT_RUNNING))
    if max_queued is not None:
        change = dataclasses.replace(change, change_queued=True, max_queued=_limit(
            "--max-queued", max_queued, MAX_ACCOUNT_QUEUED))
    if models is not None:
        change = dataclasses.replace(change, change_models=True,
                                     models=_model_patterns(models, set(providers)))
    return change


def _limit(key: str, text: str, high: int) -> int | None:
    if text.strip().lower() == RESET:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{key} must be a whole number from 0 to {high:,} or 'default', "
                         f"got {text!r}") from None
    if not 0 <= value <= high:
        raise ValueError(f"{key} must be from 0 to {high:,} (or 'default'), got {value:,}")
    return value


def _model_patterns(text: str, providers: set[str]) -> tuple[str, ...] | None:
    """`openai:*,local:*` -> the patterns; `all` -> None (every model)."""
    if text.strip().lower() in ALL_MODELS:
        return None
    patterns = tuple(p.strip() for p in text.split(","))
    if not patterns or len(patterns) > MAX_PATTERNS or any(not p for p in patterns):
        raise ValueError(f"--models must be 1 to {MAX_PATTERNS} comma-separated patterns such "
                         f"as 'openai:*,demo' (or 'all'), got {text!r}")
    for pattern in patterns:
        if len(pattern) > 200 or not _PATTERN.match(pattern):
            raise ValueError(f"--models: {pattern!r} is not a model pattern "
                             f"(`<provider>:<model>`, `*` and `?` allowed, or `demo`)")
        provider = pattern.partition(":")[0]
        if not any(ch in provider for ch in "*?[") and provider not in providers:
            raise ValueError(f"--models: {pattern!r} names the provider {provider!r}, which "
                             f"is not configured (known: {', '.join(sorted(providers))})")
    return patterns


async def set_account_limits(db: Db, name: str, change: LimitChange) -> AccountLimits:
    """Change an account's limits (creating the account if missing); returns them as now set.
    Every claim loop of the fleet is woken (a raised running limit frees queued turns)."""
    await db.fetchval(*Q.set_account_limits.bind(
        name=name, change_running=change.change_running, max_running=change.max_running,
        change_queued=change.change_queued, max_queued=change.max_queued,
        change_models=change.change_models,
        models=list(change.models) if change.models is not None else None))
    [limits] = await account_limits(db, name)
    return limits


async def account_limits(db: Db, name: str | None = None) -> list[AccountLimits]:
    """One account's limits and turns (by name), or every account's."""
    return [AccountLimits(r["id"], r["name"], r["max_running"], r["max_queued"],
                          tuple(r["models"]) if r["models"] is not None else None,
                          r["queued"], r["running"], r["last_claimed_at"])
            for r in await db.fetch(*Q.list_account_limits.bind(name=name))]
