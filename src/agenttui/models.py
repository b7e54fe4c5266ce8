"""Typed views of API v1's JSON (the wire contract of agentd.api.wire), parsed once, here.

Parsing is lenient where a newer server may add things (unknown fields are ignored, unknown
status strings are kept as plain strings) and strict where a missing field means a broken server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeVar

from agentd.vocabulary import EventType, MessageRole, MessageStatus, RunStatus

E = TypeVar("E", bound=StrEnum)


def parse_time(value: Any) -> datetime | None:
    """RFC 3339 (with a Z) to an aware datetime; None stays None."""
    if value is None:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def _enum(kind: type[E], value: Any) -> E | str:
    try:
        return kind(value)
    except ValueError:
        return str(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True, slots=True)
class Me:
    account: str
    account_id: str
    device: str
    device_id: str

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Me:
        return cls(data["account"], data["account_id"], data["device"], data["device_id"])


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    title: str
    created_at: datetime | None
    updated_at: datetime | None
    model: str | None = None  # what its runs use; None: the daemon's default model
    archived_at: datetime | None = None

    @property
    def archived(self) -> bool:
        return self.archived_at is not None

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Conversation:
        return cls(data["id"], data.get("title") or "", parse_time(data.get("created_at")),
                   parse_time(data.get("updated_at")), _opt_str(data.get("model")),
                   parse_time(data.get("archived_at")))


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: Any  # a JSON object, or what the model sent that was none (tool_arguments)


def tool_arguments(value: Any) -> Any:
    """A call's arguments as the daemon keeps them: a JSON object, or, when a model sent text
    that is no JSON object, that text as it came (the model was told it was wrong). Shown as
    they are, never refused: one bad call must not make a conversation unreadable."""
    if isinstance(value, dict):
        return dict(value)
    return {} if value is None else value


@dataclass(frozen=True, slots=True)
class Message:
    id: str
    role: MessageRole | str
    content: str
    status: MessageStatus | str
    run_id: str | None
    created_at: datetime | None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    superseded_by: str | None = None  # a retry or an edit replaced this exchange
    model: str | None = None  # on a run's answer: the model that wrote it
    usage: dict[str, Any] | None = None  # on a run's answer: its token counts
    device_id: str | None = None  # on a run's question: the device that asked it
    device: str | None = None  # and its name

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Message:
        calls = tuple(ToolCall(str(c.get("id", "")), str(c.get("name", "")),
                               tool_arguments(c.get("arguments")))
                      for c in data.get("tool_calls") or ())
        return cls(data["id"], _enum(MessageRole, data["role"]), data.get("content") or "",
                   _enum(MessageStatus, data["status"]), _opt_str(data.get("run_id")),
                   parse_time(data.get("created_at")), calls, _opt_str(data.get("tool_call_id")),
                   _opt_str(data.get("superseded_by")), _opt_str(data.get("model")),
                   data.get("usage"), _opt_str(data.get("device_id")),
                   _opt_str(data.get("device")))


@dataclass(frozen=True, slots=True)
class Run:
    id: str
    conversation_id: str
    status: RunStatus | str
    device_id: str | None = None
    device: str | None = None
    user_message_id: str | None = None
    model: str | None = None
    cancel_requested: bool = False
    worker_id: str | None = None
    fence: int | None = None
    lease_expires_at: datetime | None = None
    error: str | None = None
    usage: dict[str, Any] | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def terminal(self) -> bool:
        return isinstance(self.status, RunStatus) and self.status.terminal

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Run:
        return cls(
            id=data["id"], conversation_id=data["conversation_id"],
            status=_enum(RunStatus, data["status"]), device_id=_opt_str(data.get("device_id")),
            device=data.get("device"),
            user_message_id=_opt_str(data.get("user_message_id")), model=data.get("model"),
            cancel_requested=bool(data.get("cancel_requested")),
            worker_id=data.get("worker_id"), fence=data.get("fence"),
            lease_expires_at=parse_time(data.get("lease_expires_at")), error=data.get("error"),
            usage=data.get("usage"), created_at=parse_time(data.get("created_at")),
            started_at=parse_time(data.get("started_at")),
            finished_at=parse_time(data.get("finished_at")))


@dataclass(frozen=True, slots=True)
class Lease:
    """Who owns the conversation right now, and until when (the server's word)."""

    run_id: str
    worker_id: str | None
    device: str | None
    device_id: str | None
    fence: int | None
    expires_at: datetime | None

    @classmethod
    def from_wire(cls, data: dict[str, Any] | None) -> Lease | None:
        if not data:
            return None
        return cls(data["run_id"], data.get("worker_id"), data.get("device"),
                   _opt_str(data.get("device_id")), data.get("fence"),
                   parse_time(data.get("expires_at")))


@dataclass(frozen=True, slots=True)
class Attached:
    device: str
    device_id: str
    since: datetime | None

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Attached:
        return cls(data["device"], data["device_id"], parse_time(data.get("since")))


@dataclass(frozen=True, slots=True)
class ConversationState:
    """GET /v1/conversations/{id}, and the `snapshot` that opens every conversation feed."""

    conversation: Conversation
    messages: tuple[Message, ...]
    runs: tuple[Run, ...]
    lease: Lease | None
    attached: tuple[Attached, ...]
    usage: dict[str, Any] = field(default_factory=dict)  # token totals of all its runs
    has_more: bool = False  # a paged transcript: older turns remain on the server
    before: str | None = None  # the cursor of the next older page

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ConversationState:
        return cls(Conversation.from_wire(data),
                   tuple(Message.from_wire(m) for m in data.get("messages") or ()),
                   tuple(Run.from_wire(r) for r in data.get("runs") or ()),
                   Lease.from_wire(data.get("lease")),
                   tuple(Attached.from_wire(a) for a in data.get("attached") or ()),
                   dict(data.get("usage") or {}), bool(data.get("has_more")),
                   _opt_str(data.get("before")))


@dataclass(frozen=True, slots=True)
class MessagePage:
    """GET /v1/conversations/{id}/messages: whole turns in order, and the next older cursor."""

    messages: tuple[Message, ...]
    has_more: bool
    before: str | None

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> MessagePage:
        return cls(tuple(Message.from_wire(m) for m in data.get("messages") or ()),
                   bool(data.get("has_more")), _opt_str(data.get("before")))


@dataclass(frozen=True, slots=True)
class Draft:
    """A queued turn a stop cancelled before it ran: its text goes back to its author."""

    run_id: str
    message_id: str
    content: str

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Draft:
        return cls(data["run_id"], data["message_id"], data.get("content") or "")


@dataclass(frozen=True, slots=True)
class CreatedRun:
    run_id: str
    status: RunStatus | str
    conversation_id: str
    drafts: tuple[Draft, ...] = ()
    replayed: bool = False

    @classmethod
    def from_wire(cls, data: dict[str, Any], *, replayed: bool = False) -> CreatedRun:
        return cls(data["run_id"], _enum(RunStatus, data["status"]), data["conversation_id"],
                   tuple(Draft.from_wire(d) for d in data.get("drafts") or ()), replayed)


@dataclass(frozen=True, slots=True)
class StopResult:
    cancelled: tuple[str, ...]
    flagged: tuple[str, ...]
    drafts: tuple[Draft, ...]

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> StopResult:
        return cls(tuple(data.get("cancelled") or ()), tuple(data.get("flagged") or ()),
                   tuple(Draft.from_wire(d) for d in data.get("drafts") or ()))


@dataclass(frozen=True, slots=True)
class ModelOffer:
    """One model a configured provider offers, and whether the daemon can run it now."""

    name: str  # what a run or a conversation names
    provider: str
    kind: str
    usable: bool
    reason: str | None

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ModelOffer:
        return cls(data["name"], data.get("provider") or "", data.get("kind") or "",
                   bool(data.get("usable")), _opt_str(data.get("reason")))


@dataclass(frozen=True, slots=True)
class Models:
    """GET /v1/models: what is on offer, and what a conversation without a model uses."""

    offers: tuple[ModelOffer, ...]
    default_model: str

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Models:
        return cls(tuple(ModelOffer.from_wire(m) for m in data.get("models") or ()),
                   str(data.get("default_model") or ""))


@dataclass(frozen=True, slots=True)
class SearchHit:
    conversation_id: str
    title: str
    message_id: str | None  # None: its title matched, and it holds no message yet
    role: MessageRole | str | None
    content: str
    created_at: datetime | None

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> SearchHit:
        role = data.get("role")
        return cls(data["conversation_id"], data.get("title") or "", data.get("message_id"),
                   _enum(MessageRole, role) if role else None, data.get("content") or "",
                   parse_time(data.get("created_at")))


@dataclass(frozen=True, slots=True)
class RunEvent:
    """One journal event: `seq` orders it within its run; `payload` is the SSE data object."""

    run_id: str
    seq: int
    type: EventType | str
    payload: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: dict[str, Any], run_id: str | None = None) -> RunEvent:
        return cls(str(data.get("run_id") or run_id or ""), int(data["seq"]),
                   _enum(EventType, data["type"]), data)

    @property
    def delta(self) -> str:
        return str(self.payload.get("delta") or "")
