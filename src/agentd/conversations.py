"""Conversations and their authoritative state: transcript, active runs and the lease.

Every read is scoped by account (rule 9): another account's conversation simply does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from agentd.queries import Q
from agentd.queue import Db
from agentd.vocabulary import MessageRole, MessageStatus, RunStatus


@dataclass(frozen=True, slots=True)
class Conversation:
    id: UUID
    account_id: UUID
    title: str
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class Message:
    id: UUID
    run_id: UUID | None
    role: MessageRole
    content: str
    status: MessageStatus
    tool_calls: list[dict[str, Any]] | None
    tool_call_id: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class RunRow:
    id: UUID
    account_id: UUID
    conversation_id: UUID
    user_message_id: UUID
    origin_device_id: UUID | None
    origin_device: str | None
    status: RunStatus
    request: dict[str, Any] | None
    idempotency_key: str | None
    worker_id: str | None
    claim_token: UUID | None
    fence: int | None
    lease_expires_at: datetime | None
    last_heartbeat_at: datetime | None
    cancel_requested: bool
    error: str | None
    usage: dict[str, Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def from_record(cls, r: Any) -> RunRow:
        return cls(**{**dict(r), "status": RunStatus(r["status"])})


@dataclass(frozen=True, slots=True)
class Lease:
    run_id: UUID
    execution_id: UUID
    fence: int
    worker_id: str
    device_id: UUID | None
    device: str | None
    expires_at: datetime
    live: bool


@dataclass(frozen=True, slots=True)
class ConversationState:
    conversation: Conversation
    messages: list[Message]
    runs: list[RunRow]  # running first (at most one), then queued in run order
    lease: Lease | None


async def create_conversation(db: Db, account_id: UUID, title: str = "") -> Conversation:
    return Conversation(**dict(await db.fetchrow(*Q.create_conversation.bind(
        account_id=account_id, title=title))))


async def get_conversation(db: Db, account_id: UUID,
                           conversation_id: UUID) -> Conversation | None:
    row = await db.fetchrow(*Q.get_conversation.bind(conversation_id=conversation_id,
                                                     account_id=account_id))
    return Conversation(**dict(row)) if row else None


async def list_conversations(db: Db, account_id: UUID,
                             limit: int = 100) -> list[Conversation]:
    return [Conversation(**dict(r)) for r in
            await db.fetch(*Q.list_conversations.bind(account_id=account_id, limit=limit))]


async def get_run(db: Db, account_id: UUID, run_id: UUID) -> RunRow | None:
    row = await db.fetchrow(*Q.get_run.bind(run_id=run_id, account_id=account_id))
    return RunRow.from_record(row) if row else None


async def conversation_state(db: Db, account_id: UUID,
                             conversation_id: UUID) -> ConversationState | None:
    """The server's authority on a conversation, as every client reconciles to it."""
    conversation = await get_conversation(db, account_id, conversation_id)
    if conversation is None:
        return None
    messages = [
        Message(r["id"], r["run_id"], MessageRole(r["role"]), r["content"],
                MessageStatus(r["status"]), r["tool_calls"], r["tool_call_id"], r["created_at"])
        for r in await db.fetch(*Q.list_messages.bind(conversation_id=conversation_id))]
    runs = [RunRow.from_record(r) for r in await db.fetch(
        *Q.list_active_runs.bind(conversation_id=conversation_id))]
    runs.sort(key=lambda run: run.status != RunStatus.RUNNING)
    row = await db.fetchrow(*Q.get_conversation_lease.bind(account_id=account_id,
                                                           conversation_id=conversation_id))
    lease = Lease(**dict(row)) if row else None
    return ConversationState(conversation, messages, runs, lease)
