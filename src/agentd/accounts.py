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
    return (await db.fetchrow(Q["ensure_account"], name))["id"]


async def create_device_token(db: Db, *, account: str, device: str) -> tuple[str, UUID]:
    """Mint a token for a new device of `account` (created if missing); returns (token, id)."""
    account_id = await ensure_account(db, account)
    token = new_token()
    row = await db.fetchrow(Q["create_device"], account_id, device, hash_token(token))
    return token, row["id"]


async def authenticate(db: Db, token: str) -> Principal | None:
    """The principal a bearer token names, or None (unknown or revoked)."""
    digest = hash_token(token)
    row = await db.fetchrow(Q["authenticate_device"], digest)
    if row is None:
        # Same work on the miss path, so timing says nothing about near-miss tokens.
        hmac.compare_digest(digest, digest)
        return None
    return Principal(row["account_id"], row["account_name"], row["device_id"],
                     row["device_name"])


async def list_devices(db: Db) -> list[DeviceInfo]:
    return [DeviceInfo(r["id"], r["account"], r["name"], r["created_at"], r["last_seen_at"],
                       r["revoked_at"]) for r in await db.fetch(Q["list_devices"])]


async def revoke_device(db: Db, device_id: UUID, *, account_id: UUID | None = None) -> bool:
    """Revoke a device (of `account_id` only, when given); False if no such active device.

    Its presence goes at once and its open streams end (agentd.revocation).
    """
    return await db.fetchval(Q["revoke_device"], device_id, account_id) is not None


async def account_devices(db: Db, account_id: UUID) -> list[DeviceInfo]:
    """The devices of one account (the account name is left empty: the caller knows it)."""
    return [DeviceInfo(r["id"], "", r["name"], r["created_at"], r["last_seen_at"],
                       r["revoked_at"])
            for r in await db.fetch(Q["list_account_devices"], account_id)]
