"""The one vocabulary of statuses, event types and NOTIFY channels.

Daemon, client, tests and docs import these names; the SQL CHECK constraints list the same values
(a test compares them), so a status can never exist in one place and not the other.
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_RUN_STATUSES


TERMINAL_RUN_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})
ACTIVE_RUN_STATUSES = frozenset({RunStatus.QUEUED, RunStatus.RUNNING})


class MessageStatus(StrEnum):
    QUEUED = "queued"  # a user turn waiting for its run
    COMPLETE = "complete"  # a user turn that ran, or a finished assistant answer
    PARTIAL = "partial"  # an assistant answer cut short (cancel, failure) and kept
    CANCELLED = "cancelled"  # a tool result synthesized for a call a cancel interrupted
    DRAFT = "draft"  # a queued user turn a stop handed back to its author


class MessageRole(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class EventType(StrEnum):
    USER_MESSAGE = "user_message"
    RUN_QUEUED = "run_queued"
    RUN_STARTED = "run_started"
    CONTENT_DELTA = "content_delta"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    APPROVAL_REQUESTED = "approval_requested"  # an `ask` tool call waits for a device's decision
    APPROVAL_DECIDED = "approval_decided"  # a device decided it, or the wait timed out
    CANCEL_REQUESTED = "cancel_requested"
    COMPLETE = "complete"


# Events whose payloads are merged in memory and flushed on a clock; all others write through.
DELTA_EVENT_TYPES = frozenset({EventType.CONTENT_DELTA})


class Channel(StrEnum):
    """NOTIFY channels. Payloads carry one id only (8000-byte limit); consumers re-read rows."""

    RUN_ENQUEUED = "agentd_run_enqueued"  # payload: conversation id; wakes dispatchers
    RUN_EVENT = "agentd_run_event"  # payload: run id; wakes tails of that run
    RUN_CANCEL = "agentd_run_cancel"  # payload: run id; wakes that run's cancel watcher
    CONVERSATION = "agentd_conversation"  # payload: conversation id; ownership/presence changed
    DEVICE = "agentd_device"  # payload: device id; it was revoked (its streams end)
    APPROVAL = "agentd_approval"  # payload: run id; a tool approval of that run was decided


# The SSE event that ends a stream the server will not continue (e.g. its device was revoked):
# data {"type": "error", "error": {"code", "message"}}. Not a journal event: it has no seq.
STREAM_ERROR_EVENT = "error"


class ApprovalPolicy(StrEnum):
    """What happens when the model calls a tool: run it, ask a device first, or refuse it."""

    AUTO = "auto"
    ASK = "ask"
    DENY = "deny"


class ApprovalDecision(StrEnum):
    APPROVE = "approve"
    DENY = "deny"
