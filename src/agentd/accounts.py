"""Accounts and device credentials: bearer tokens are minted here and stored only as hashes."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from agentd.queries import Q
from agentd.queue import Db

TOKEN_PREFIX = "agd_"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is: resolved from a bearer token before anything else is touched."""

    account_id: UUID
    account_name: str
    device_id: UUID
    device_name: str


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    id: UUID
    account: str
    name: str
    created_at: datetime
    last_seen_at: datetime | None
    revoked_at: datetime | None


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


async def ensure_account(db: Db, name: str) -> UUID:
    return (await db.fetchrow(*Q.ensure_account.bind(name=name)))["id"]


async def create_device_token(db: Db, *, account: str, device: str) -> tuple[str, UUID]:
    """Mint a token for a new device of `account` (created if missing); returns (token, id)."""
    account_id = await ensure_account(db, account)
    token = new_token()
    row = await db.fetchrow(*Q.create_device.bind(account_id=account_id, name=device,
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
    return Principal(row["account_id"], row["account_name"], row["device_id"],
                     row["device_name"])


async def list_devices(db: Db) -> list[DeviceInfo]:
    return [DeviceInfo(r["id"], r["account"], r["name"], r["created_at"], r["last_seen_at"],
                       r["revoked_at"]) for r in await db.fetch(Q.list_devices.sql)]


async def revoke_device(db: Db, device_id: UUID, *, account_id: UUID | None = None) -> bool:
    """Revoke a device (of `account_id` only, when given); False if no such active device.

    Its presence goes at once and its open streams end (agentd.revocation).
    """
    revoked = await db.fetchval(*Q.revoke_device.bind(device_id=device_id,
                                                      account_id=account_id))
    return revoked is not None


async def account_devices(db: Db, account_id: UUID) -> list[DeviceInfo]:
    """The devices of one account (the account name is left empty: the caller knows it)."""
    return [DeviceInfo(r["id"], "", r["name"], r["created_at"], r["last_seen_at"],
                       r["revoked_at"])
            for r in await db.fetch(*Q.list_account_devices.bind(account_id=account_id))]


# pairing codes ---------------------------------------------------------------------------------


async def store_pairing(db: Db, *, code_hash: bytes, account_id: UUID, device_name: str | None,
                        created_by: UUID | None, ttl_s: float) -> datetime:
    """Keep a one-time code's hash until its deadline (database clock); returns the deadline."""
    expires_at: datetime = await db.fetchval(*Q.create_pairing.bind(
        code_hash=code_hash, account_id=account_id, device_name=device_name,
        created_by=created_by, ttl_s=ttl_s))
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
