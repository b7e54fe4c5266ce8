"""Pairing codes: how a new device gets its bearer token without anyone copying a token.

A code is 10 Crockford base32 characters (50 bits) shown as `XXXXX-XXXXX`: typed by a person,
forgiving of case, dashes, spaces and the letters O, I and L. It is stored only as its SHA-256,
valid for `pairing_ttl_s`, and spent by the one statement that creates the device. Guessing is
bounded by the per-address rate limit of POST /v1/pair (agentd.limits) and the short validity.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from agentd import accounts
from agentd.accounts import Principal, hash_token, new_token
from agentd.db import Db

ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford's base32: no I, L, O, U
CODE_CHARS = 10  # 50 bits
GROUP = 5
# Codes of one account neither spent nor expired at once: enough for an operator pairing a
# team's machines, not a table any device can grow without bound.
MAX_OPEN_CODES = 20
_READ_AS = str.maketrans({"O": "0", "I": "1", "L": "1"})
_SEPARATORS = str.maketrans("", "", "- _")


@dataclass(frozen=True, slots=True)
class Pairing:
    code: str
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Redeemed:
    token: str  # answered once, never stored
    principal: Principal


def new_code() -> str:
    raw = "".join(secrets.choice(ALPHABET) for _ in range(CODE_CHARS))
    return "-".join(raw[i:i + GROUP] for i in range(0, CODE_CHARS, GROUP))


def normalize_code(text: str) -> str | None:
    """The canonical characters of a code as typed, or None if it cannot be one."""
    compact = text.upper().translate(_SEPARATORS).translate(_READ_AS)
    if len(compact) != CODE_CHARS or any(c not in ALPHABET for c in compact):
        return None
    return compact


def code_hash(code: str) -> bytes:
    """The stored form of a (normalized) code."""
    return hashlib.sha256(code.encode()).digest()


class TooManyOpenCodes(Exception):
    """The account holds MAX_OPEN_CODES codes neither spent nor expired: none is minted."""


async def create_pairing(db: Db, *, account_id: UUID, device_name: str | None,
                         created_by: UUID | None, ttl_s: float) -> Pairing:
    """A new one-time code; TooManyOpenCodes past MAX_OPEN_CODES of the account's."""
    code = new_code()
    normalized = normalize_code(code)
    assert normalized is not None
    expires_at = await accounts.store_pairing(
        db, code_hash=code_hash(normalized), account_id=account_id, device_name=device_name,
        created_by=created_by, ttl_s=ttl_s, max_open=MAX_OPEN_CODES)
    if expires_at is None:
        raise TooManyOpenCodes(f"the account already has {MAX_OPEN_CODES} pairing codes that "
                               "are neither used nor expired; use one, or wait until they "
                               "expire")
    return Pairing(code, expires_at)


async def redeem(db: Db, code: str, device_name: str) -> Redeemed | None:
    """Spend `code` for a new device; None when it is unknown, spent or expired."""
    normalized = normalize_code(code)
    # A malformed code costs the same statement as a wrong one: its hash matches no row.
    digest = code_hash(normalized if normalized is not None else code)
    token = new_token()
    who = await accounts.redeem_pairing(db, code_hash=digest, device_name=device_name,
                                        token_hash=hash_token(token))
    return None if who is None else Redeemed(token, who)


async def purge_pairings(db: Db, *, older_than_s: float) -> int:
    return await accounts.purge_pairings(db, older_than_s=older_than_s)
