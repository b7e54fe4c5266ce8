"""Tool approvals on PostgreSQL: the worker asks (fenced), any device of the account decides.

The first decision wins in one statement (decide_tool_approval): the decision columns are
written only while empty, before the deadline, and while the execution that asked still owns
the run. A timeout is the worker's own "deny" through the same guard, so exactly one lands.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from agentd.db import Db
from agentd.pgtext import clean
from agentd.queries import Q
from agentd.queue import Claim, LeaseLost
from agentd.vocabulary import ApprovalDecision


class DuplicateCall(Exception):
    """The model reused a call id this run already asked about; nothing was recorded."""


@dataclass(frozen=True, slots=True)
class Asked:
    """A pending approval as its execution recorded it."""

    expires_at: datetime
    device_id: UUID | None  # the device that asked the turn
    device: str | None


@dataclass(frozen=True, slots=True)
class Decision:
    decision: ApprovalDecision
    device_id: UUID | None  # None when the wait timed out
    device: str | None
    timed_out: bool
    note: str | None
    decided_at: datetime


@dataclass(frozen=True, slots=True)
class Waiting:
    """Undecided: how long is left by the database clock."""

    seconds_left: float


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a device's decision did not land (read after the decision statement changed nothing)."""

    exists: bool
    decision: Decision | None  # decided already (by a device or the timeout)
    expired: bool
    waiting: bool  # the execution that asked still waits for it
    decider_revoked: bool = False  # the deciding device was revoked since its token was checked


def _decision(row: Any) -> Decision:
    return Decision(ApprovalDecision(row["decision"]), row["decided_by"],
                    row["decided_by_name"], row["timed_out"], row["note"], row["decided_at"])


async def request_approval(db: Db, claim: Claim, *, call_id: str, tool: str,
                           arguments: Any, timeout_s: float) -> Asked:
    """Record a pending approval behind the fence; raises LeaseLost, or DuplicateCall."""
    row = await db.fetchrow(*Q.request_tool_approval_fenced.bind(
        run_id=claim.run_id, claim_token=claim.claim_token, call_id=call_id, tool=tool,
        arguments=clean(arguments), timeout_s=timeout_s))
    if row is not None:
        return Asked(row["expires_at"], row["device_id"], row["device"])
    if await read_approval(db, claim.run_id, call_id) is None:
        raise LeaseLost(claim.run_id, "approval request")
    raise DuplicateCall(call_id)


async def read_approval(db: Db, run_id: UUID, call_id: str) -> Decision | Waiting | None:
    """The decision, or how long is left; None when there is no such approval."""
    row = await db.fetchrow(*Q.read_tool_approval.bind(run_id=run_id, call_id=call_id))
    if row is None:
        return None
    if row["decision"] is None:
        return Waiting(max(0.0, row["seconds_left"]))
    return _decision(row)


async def expire_approval(db: Db, claim: Claim, *, call_id: str, note: str) -> bool:
    """Deny an approval past its deadline as timed out; False when it was decided first (or
    the lease is gone: the caller re-reads and learns which)."""
    return await db.fetchval(*Q.expire_tool_approval_fenced.bind(
        run_id=claim.run_id, claim_token=claim.claim_token, call_id=call_id,
        note=note)) is not None


async def decide_approval(db: Db, *, run_id: UUID, call_id: str, account_id: UUID,
                          device_id: UUID, decision: ApprovalDecision,
                          note: str | None) -> Decision | None:
    """A device's decision; None when it did not land (see explain_refusal)."""
    row = await db.fetchrow(*Q.decide_tool_approval.bind(
        run_id=run_id, call_id=call_id, account_id=account_id, device_id=device_id,
        decision=str(decision), note=note))
    if row is None:
        return None
    return Decision(ApprovalDecision(row["decision"]), device_id, row["decided_by_name"],
                    False, row["note"], row["decided_at"])


async def explain_refusal(db: Db, *, run_id: UUID, call_id: str, account_id: UUID,
                          device_id: UUID) -> Refusal:
    row = await db.fetchrow(*Q.explain_tool_approval.bind(
        run_id=run_id, call_id=call_id, account_id=account_id, device_id=device_id))
    if row is None:
        return Refusal(False, None, False, False)
    decided = _decision(row) if row["decision"] is not None else None
    return Refusal(True, decided, row["expired"], row["waiting"], row["decider_revoked"])


async def list_approvals(db: Db, run_id: UUID, account_id: UUID) -> list[dict[str, Any]]:
    """A run's approvals, oldest first, as plain rows (the API shapes them)."""
    rows = await db.fetch(*Q.list_tool_approvals.bind(run_id=run_id, account_id=account_id))
    return [dict(row) for row in rows]
