"""Conversations and their authoritative state: transcript, active runs and the lease.

Every read is scoped by account (rule 9): another account's conversation simply does not exist.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
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
    model: str | None  # what its runs default to; None: the daemon's default_model
    archived_at: datetime | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_record(cls, r: Any) -> Conversation:
        return cls(r["id"], r["account_id"], r["title"], r["model"], r["archived_at"],
                   r["created_at"], r["updated_at"])


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
    superseded_by: UUID | None = None  # the user message of the exchange that replaced it
    model: str | None = None  # on a run's answer: the model that wrote it
    usage: dict[str, Any] | None = None  # on a run's answer: the run's token counts


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
    usage: dict[str, int] = field(default_factory=dict)  # token totals of all its runs


@dataclass(frozen=True, slots=True)
class ConversationMeta:
    """What a conversation feed re-reads when told the conversation changed."""

    conversation: Conversation
    superseded: dict[UUID, UUID]  # message id -> the user message that replaced it
    usage: dict[str, int]

    @classmethod
    def from_record(cls, r: Any) -> ConversationMeta:
        return cls(Conversation.from_record(r),
                   {UUID(k): UUID(v) for k, v in (r["superseded"] or {}).items()},
                   dict(r["usage"] or {}))


async def create_conversation(db: Db, account_id: UUID, title: str = "",
                              model: str | None = None) -> Conversation:
    return Conversation.from_record(
        await db.fetchrow(Q["create_conversation"], account_id, title, model))


async def get_conversation(db: Db, account_id: UUID,
                           conversation_id: UUID) -> Conversation | None:
    row = await db.fetchrow(Q["get_conversation"], conversation_id, account_id)
    return Conversation.from_record(row) if row else None


async def list_conversations(db: Db, account_id: UUID, limit: int = 100, *,
                             archived: bool = False) -> list[Conversation]:
    return [Conversation.from_record(r) for r in
            await db.fetch(Q["list_conversations"], account_id, limit, archived)]


async def conversation_meta(db: Db, account_id: UUID,
                            conversation_id: UUID) -> ConversationMeta | None:
    row = await db.fetchrow(Q["conversation_meta"], conversation_id, account_id)
    return ConversationMeta.from_record(row) if row else None


async def get_run(db: Db, account_id: UUID, run_id: UUID) -> RunRow | None:
    row = await db.fetchrow(Q["get_run"], run_id, account_id)
    return RunRow.from_record(row) if row else None


async def conversation_state(db: Db, account_id: UUID,
                             conversation_id: UUID) -> ConversationState | None:
    """The server's authority on a conversation, as every client reconciles to it."""
    meta = await conversation_meta(db, account_id, conversation_id)
    if meta is None:
        return None
    messages = [
        Message(r["id"], r["run_id"], MessageRole(r["role"]), r["content"],
                MessageStatus(r["status"]), r["tool_calls"], r["tool_call_id"], r["created_at"],
                meta.superseded.get(r["id"]))
        for r in await db.fetch(Q["list_messages"], conversation_id)]
    messages = _with_usage(messages, await db.fetch(Q["conversation_run_usage"],
                                                    conversation_id))
    runs = [RunRow.from_record(r) for r in await db.fetch(Q["list_active_runs"], conversation_id)]
    runs.sort(key=lambda run: run.status != RunStatus.RUNNING)
    row = await db.fetchrow(Q["get_conversation_lease"], account_id, conversation_id)
    lease = Lease(**dict(row)) if row else None
    return ConversationState(meta.conversation, messages, runs, lease, meta.usage)


def _with_usage(messages: list[Message], runs: list[Any]) -> list[Message]:
    """Each run's model and token counts on its answer: the run's last assistant message."""
    by_run = {r["id"]: r for r in runs}
    answers = {m.run_id: i for i, m in enumerate(messages)
               if m.role == MessageRole.ASSISTANT and m.run_id in by_run}
    for run_id, index in answers.items():
        run = by_run[run_id]
        messages[index] = dataclasses.replace(messages[index], model=run["model"],
                                              usage=run["usage"])
    return messages
