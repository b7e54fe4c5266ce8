"""Conversations and their authoritative state: transcript, active runs, the lease, the devices
attached (presence) and the notebook the `notes` tool writes.

Every read is scoped by account (authorize before competing: docs/architecture.md): another
account's conversation simply does not exist.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

import asyncpg

from agentd.db import Conn, Db, fetch_one
from agentd.queries import Q
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
    device_id: UUID | None = None  # on a run's question: the device that asked it
    device: str | None = None  # that device's name


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
    error_code: str | None = None  # with `error`, for a run that failed (RunErrorCode)

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

    @classmethod
    def from_meta_record(cls, r: Any) -> Lease | None:
        """The lease columns of a conversation_meta row (None: nobody holds one)."""
        if r["lease_run_id"] is None:
            return None
        return cls(r["lease_run_id"], r["lease_execution_id"], r["lease_fence"],
                   r["lease_worker_id"], r["lease_device_id"], r["lease_device"],
                   r["lease_expires_at"], r["lease_live"])


@dataclass(frozen=True, slots=True)
class Attached:
    """A device attached to a conversation now, since its earliest open stream."""

    device_id: UUID
    device: str
    since: datetime


@dataclass(frozen=True, slots=True)
class Note:
    """One entry of a conversation's notebook, with the run that wrote it."""

    id: int
    text: str
    run_id: UUID | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ConversationState:
    conversation: Conversation
    messages: list[Message]
    runs: list[RunRow]  # running first (at most one), then queued in run order
    lease: Lease | None
    usage: dict[str, int] = field(default_factory=dict)  # token totals of all its runs
    # Paged (a `limit` was asked): older turns remain before `messages`; page on from `before`.
    has_more: bool = False
    before: UUID | None = None
    attached: tuple[Attached, ...] = ()  # devices attached now, earliest first


@dataclass(frozen=True, slots=True)
class MessagePage:
    """One page of a transcript (turn order), and the cursor of the next older page."""

    messages: list[Message]
    has_more: bool
    before: UUID | None  # the page's first message: `before` of the next older page


class UnknownCursor(LookupError):
    """A paging cursor that names no message of the conversation; args[0] is the parameter."""


NO_TURN_BOUND = 2**63 - 1  # "before the end": every turn position is below it


@dataclass(frozen=True, slots=True)
class ConversationMeta:
    """What a conversation feed re-reads, in one round trip, when told the conversation changed
    or one of its turns started or ended: the conversation, who owns it, who is attached."""

    conversation: Conversation
    superseded: dict[UUID, UUID]  # message id -> the user message that replaced it
    usage: dict[str, int]
    lease: Lease | None
    attached: tuple[Attached, ...]  # earliest first

    @classmethod
    def from_record(cls, r: Any) -> ConversationMeta:
        return cls(Conversation.from_record(r),
                   {UUID(k): UUID(v) for k, v in (r["superseded"] or {}).items()},
                   dict(r["usage"] or {}), Lease.from_meta_record(r),
                   tuple(Attached(*a) for a in zip(r["attached_device_ids"],
                                                   r["attached_devices"], r["attached_since"],
                                                   strict=True)))


async def create_conversation(db: Db, account_id: UUID, title: str = "",
                              model: str | None = None) -> Conversation:
    return Conversation.from_record(await db.fetchrow(*Q.create_conversation.bind(
        account_id=account_id, title=title, model=model)))


async def get_conversation(db: Db, account_id: UUID,
                           conversation_id: UUID) -> Conversation | None:
    row = await db.fetchrow(*Q.get_conversation.bind(conversation_id=conversation_id,
                                                     account_id=account_id))
    return Conversation.from_record(row) if row else None


# A place in the conversation list (most recently active first): the last one handed out's
# updated_at and id.
ListMark = tuple[datetime, UUID]


async def list_conversations(db: Db, account_id: UUID, limit: int = 100, *,
                             archived: bool = False,
                             after: ListMark | None = None) -> list[Conversation]:
    return [Conversation.from_record(r) for r in await db.fetch(*Q.list_conversations.bind(
        account_id=account_id, limit=limit, archived=archived,
        after_updated_at=after[0] if after else None, after_id=after[1] if after else None))]


async def conversation_meta(db: Db, account_id: UUID,
                            conversation_id: UUID) -> ConversationMeta | None:
    row = await db.fetchrow(*Q.conversation_meta.bind(conversation_id=conversation_id,
                                                      account_id=account_id))
    return ConversationMeta.from_record(row) if row else None


async def get_run(db: Db, account_id: UUID, run_id: UUID) -> RunRow | None:
    row = await db.fetchrow(*Q.get_run.bind(run_id=run_id, account_id=account_id))
    return RunRow.from_record(row) if row else None


async def conversation_state(db: Db, account_id: UUID, conversation_id: UUID, *,
                             limit: int | None = None) -> ConversationState | None:
    """The server's authority on a conversation, as every client reconciles to it. With a
    `limit`, the transcript is its newest page only (see message_page), reaching back to the
    question of every run listed: a client shows a run with its question, and more queued
    turns than the page holds used to leave the running one's out of it."""
    meta = await conversation_meta(db, account_id, conversation_id)
    if meta is None:
        return None
    runs = await list_active_runs(db, conversation_id)  # in run order: the oldest first
    if limit is None:
        rows = await db.fetch(*Q.list_messages.bind(conversation_id=conversation_id))
        page = MessagePage(_messages(rows, meta), False, None)
    else:
        oldest = None if not runs else \
            await _turn_position(db, conversation_id, runs[0].user_message_id, "until")
        page = await _page(db, meta, conversation_id, NO_TURN_BOUND, limit, oldest)
    messages = await _with_runs(db, conversation_id, page.messages)
    runs.sort(key=lambda run: run.status != RunStatus.RUNNING)
    return ConversationState(meta.conversation, messages, runs, meta.lease, meta.usage,
                             page.has_more, page.before, meta.attached)


async def message_page(db: Db, account_id: UUID, conversation_id: UUID, *,
                       before: UUID | None, limit: int,
                       until: UUID | None = None) -> MessagePage | None:
    """The `limit` newest messages of the turns before message `before` (the newest page when
    None), whole turns only, reaching back to message `until`'s turn if given. None: not a
    conversation of this account; UnknownCursor: a cursor names no message of it."""
    meta = await conversation_meta(db, account_id, conversation_id)
    if meta is None:
        return None
    before_turn = NO_TURN_BOUND if before is None else \
        await _turn_position(db, conversation_id, before, "before")
    until_turn = None if until is None else \
        await _turn_position(db, conversation_id, until, "until")
    page = await _page(db, meta, conversation_id, before_turn, limit, until_turn)
    return dataclasses.replace(page, messages=await _with_runs(db, conversation_id,
                                                               page.messages))


class TranscriptChanged(Exception):
    """Messages an export planned to read are gone: the conversation was deleted meanwhile."""


async def transcript_ids(db: Db, account_id: UUID, conversation_id: UUID) -> list[UUID]:
    """The ids of the transcript in turn order, drafts left out (an export's plan)."""
    return [r["id"] for r in await db.fetch(*Q.list_message_ids.bind(
        conversation_id=conversation_id, account_id=account_id))]


async def messages_by_id(db: Db, conversation_id: UUID, ids: list[UUID]) -> list[Message]:
    """These messages, in this order; TranscriptChanged if any is gone."""
    rows = {r["id"]: r for r in await db.fetch(*Q.messages_by_id.bind(
        conversation_id=conversation_id, ids=ids))}
    if len(rows) < len(ids):
        raise TranscriptChanged(conversation_id)
    return [Message(r["id"], r["run_id"], MessageRole(r["role"]), r["content"],
                    MessageStatus(r["status"]), r["tool_calls"], r["tool_call_id"],
                    r["created_at"], r["superseded_by"]) for r in map(rows.__getitem__, ids)]


async def _turn_position(db: Db, conversation_id: UUID, message_id: UUID, name: str) -> int:
    position = await db.fetchval(*Q.message_turn_position.bind(
        conversation_id=conversation_id, message_id=message_id))
    if position is None:
        raise UnknownCursor(name)
    return int(position)


async def _page(db: Db, meta: ConversationMeta, conversation_id: UUID, before_turn: int,
                limit: int, until_turn: int | None) -> MessagePage:
    rows = await db.fetch(*Q.list_messages_page.bind(
        conversation_id=conversation_id, before_turn=before_turn, limit=limit,
        until_turn=until_turn))
    has_more = bool(rows and rows[0]["has_more"])
    return MessagePage(_messages(rows, meta), has_more, rows[0]["id"] if has_more else None)


def _messages(rows: list[Any], meta: ConversationMeta) -> list[Message]:
    return [Message(r["id"], r["run_id"], MessageRole(r["role"]), r["content"],
                    MessageStatus(r["status"]), r["tool_calls"], r["tool_call_id"],
                    r["created_at"], meta.superseded.get(r["id"])) for r in rows]


async def _with_runs(db: Db, conversation_id: UUID, messages: list[Message]) -> list[Message]:
    """Each run's model and token counts on its answer (the run's last assistant message), and
    the device that asked on its question: read for the page's runs only."""
    run_ids = list({m.run_id for m in messages if m.run_id is not None})
    if not run_ids:
        return messages
    by_run = {r["id"]: r for r in await db.fetch(*Q.runs_of_messages.bind(
        conversation_id=conversation_id, run_ids=run_ids))}
    answers = {m.run_id: i for i, m in enumerate(messages)
               if m.role == MessageRole.ASSISTANT and m.run_id in by_run}
    for index, message in enumerate(messages):
        run = by_run.get(message.run_id)
        if run is None:
            continue
        if message.role == MessageRole.USER:
            messages[index] = dataclasses.replace(message, device_id=run["origin_device_id"],
                                                  device=run["device"])
        elif answers.get(message.run_id) == index and run["usage"] is not None:
            messages[index] = dataclasses.replace(message, model=run["model"],
                                                  usage=run["usage"])
    return messages


async def update_conversation(db: Db, account_id: UUID, conversation_id: UUID, *,
                              title: str | None, set_model: bool, model: str | None,
                              archived: bool | None) -> Conversation | None:
    """Rename, set the model, archive or restore: only what is given; None if not yours."""
    row = await db.fetchrow(*Q.update_conversation.bind(
        conversation_id=conversation_id, account_id=account_id, title=title,
        set_model=set_model, model=model, archived=archived))
    return Conversation.from_record(row) if row else None


async def fork_conversation(db: Db, account_id: UUID, conversation_id: UUID,
                            message_id: UUID) -> asyncpg.Record | None:
    """Copy the transcript up to a message into a new conversation (the fork_conversation
    statement says how to read its columns); None: no such conversation."""
    row: asyncpg.Record | None = await db.fetchrow(*Q.fork_conversation.bind(
        conversation_id=conversation_id, account_id=account_id, message_id=message_id))
    return row


async def retry_target(conn: Conn, conversation_id: UUID,
                       message_id: UUID | None) -> asyncpg.Record:
    """The latest turn and the message a retry names (under lock_conversation)."""
    return await fetch_one(conn, *Q.retry_target.bind(conversation_id=conversation_id,
                                                       message_id=message_id))


async def supersede_exchange(conn: Conn, conversation_id: UUID,
                             message_id: UUID, superseded_by: UUID) -> None:
    """Mark the retried exchange as replaced by the new user message (same transaction)."""
    await conn.execute(*Q.supersede_exchange.bind(
        conversation_id=conversation_id, message_id=message_id, superseded_by=superseded_by))


@dataclass(frozen=True, slots=True)
class LockedConversation:
    """What a transaction that locked the conversation's row may rely on until it ends."""

    model: str | None  # None: the daemon's default_model


async def lock_conversation(conn: Conn, account_id: UUID,
                            conversation_id: UUID) -> LockedConversation | None:
    """Serialize with enqueues and stops of this conversation until the transaction ends;
    None when the account has no such conversation."""
    row = await conn.fetchrow(*Q.lock_conversation.bind(
        conversation_id=conversation_id, account_id=account_id))
    return None if row is None else LockedConversation(row["model"])


async def list_active_runs(db: Db, conversation_id: UUID) -> list[RunRow]:
    """The running turn and the queued ones, in run order (created_at, id)."""
    return [RunRow.from_record(r) for r in await db.fetch(
        *Q.list_active_runs.bind(conversation_id=conversation_id))]


async def latest_run(db: Db, conversation_id: UUID) -> tuple[datetime, UUID] | None:
    """(created_at, id) of the conversation's newest run: a feed's starting watermark."""
    row = await db.fetchrow(*Q.latest_run_of_conversation.bind(conversation_id=conversation_id))
    return (row["created_at"], row["id"]) if row else None


async def runs_since(db: Db, conversation_id: UUID, watermark: tuple[datetime, UUID],
                     open_run_ids: list[UUID]) -> list[asyncpg.Record]:
    """Runs after the watermark plus the open ones: id, status, created_at, cancel_requested."""
    rows: list[asyncpg.Record] = await db.fetch(*Q.list_runs_of_conversation_since.bind(
        conversation_id=conversation_id, after_created_at=watermark[0], after_id=watermark[1],
        open_run_ids=open_run_ids))
    return rows


async def transcript_for_run(db: Db, conversation_id: UUID,
                             user_message_id: UUID) -> list[asyncpg.Record]:
    """What the model sees for a turn: role, content, tool_calls, tool_call_id in turn order."""
    rows: list[asyncpg.Record] = await db.fetch(*Q.transcript_for_run.bind(
        conversation_id=conversation_id, user_message_id=user_message_id))
    return rows


# How much of a message a search hit carries: the part around the first match.
SEARCH_EXCERPT_CHARS = 400


async def search_messages(db: Db, account_id: UUID, query: str,
                          limit: int) -> list[asyncpg.Record]:
    """Messages and titles containing `query` (any case), newest first; each hit's content is
    at most SEARCH_EXCERPT_CHARS characters around the first match (`truncated` when cut)."""
    escaped = query.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    rows: list[asyncpg.Record] = await db.fetch(*Q.search_messages.bind(
        account_id=account_id, pattern=f"%{escaped}%", limit=limit, needle=query,
        width=SEARCH_EXCERPT_CHARS))
    return rows


# presence -----------------------------------------------------------------------------------

async def attach_presence(db: Db, account_id: UUID, conversation_id: UUID, device_id: UUID,
                          ttl_s: float) -> UUID:
    presence_id: UUID = await db.fetchval(*Q.presence_attach.bind(
        account_id=account_id, conversation_id=conversation_id, device_id=device_id,
        ttl_s=ttl_s))
    return presence_id


async def renew_presence(db: Db, presence_id: UUID, ttl_s: float) -> bool:
    """False when it had expired (the stream attaches again)."""
    return await db.fetchval(*Q.presence_renew.bind(presence_id=presence_id,
                                                    ttl_s=ttl_s)) is not None


async def detach_presence(db: Db, presence_id: UUID) -> None:
    await db.execute(*Q.presence_detach.bind(presence_id=presence_id))


# the notebook -------------------------------------------------------------------------------

async def append_note(db: Db, *, conversation_id: UUID, run_id: UUID, fence: int,
                      text: str) -> Note | None:
    """Append behind the notebook's fence; None (nothing written) for a superseded fence."""
    row = await db.fetchrow(*Q.append_note_fenced.bind(
        conversation_id=conversation_id, fence=fence, run_id=run_id, text=text))
    return Note(row["id"], text, run_id, row["created_at"]) if row else None


async def note_fence_mark(db: Db, conversation_id: UUID) -> int | None:
    """The highest fence the notebook has accepted for the conversation."""
    mark: int | None = await db.fetchval(*Q.note_fence_mark.bind(
        conversation_id=conversation_id))
    return mark


async def list_notes(db: Db, conversation_id: UUID, limit: int) -> list[Note]:
    """The latest `limit` notes, oldest first."""
    return [Note(r["id"], r["text"], r["run_id"], r["created_at"]) for r in await db.fetch(
        *Q.list_notes.bind(conversation_id=conversation_id, limit=limit))]


async def count_attached_devices(db: Db) -> int:
    """Devices holding a conversation stream open anywhere in the fleet (each once)."""
    count: int = await db.fetchval(Q.count_attached_devices.sql)
    return count
