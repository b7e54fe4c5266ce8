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


class RunErrorCode(StrEnum):
    """Why a run ended without its answer: a stable code clients can act on. The run's `error`
    beside it is a short message fit for any client; the detail is in the daemon's log."""

    DEADLINE_EXCEEDED = "deadline_exceeded"  # the turn ran past max_run_s
    PROVIDER_ERROR = "provider_error"  # the model provider failed (nothing more specific)
    PROVIDER_TIMEOUT = "provider_timeout"  # a model call took too long or went silent
    PROVIDER_UNAVAILABLE = "provider_unavailable"  # unreachable, or failing on its side (5xx)
    PROVIDER_AUTH = "provider_auth"  # the provider refused the daemon's credentials
    PROVIDER_RATE_LIMITED = "provider_rate_limited"  # the provider is rate limiting us
    PROVIDER_REJECTED = "provider_rejected"  # the provider refused the request (4xx)
    MODEL_UNAVAILABLE = "model_unavailable"  # the model cannot run on this daemon now
    TOOL_STEPS_EXCEEDED = "tool_steps_exceeded"  # more tool rounds than max_tool_steps
    LEASE_EXPIRED = "lease_expired"  # its worker stopped renewing the lease (crashed, frozen)
    SHUTDOWN = "shutdown"  # the daemon stopped before the turn finished (drain_s, or cut short)
    INTERNAL_ERROR = "internal_error"  # a bug: the log has the traceback
    STOPPED_BEFORE_START = "stopped_before_start"  # a stop cancelled it while queued


class MessageStatus(StrEnum):
    QUEUED = "queued"  # a user turn waiting for its run
    COMPLETE = "complete"  # a user turn that ran, or a finished assistant answer
    PARTIAL = "partial"  # an assistant answer a stop cut short, kept
    FAILED = "failed"  # what a failed turn had streamed, kept as every client saw it
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
    HUB_PROBE = "agentd_hub_probe"  # payload: a random token; a hub checks its LISTEN hears


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
