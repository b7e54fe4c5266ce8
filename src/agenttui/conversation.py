"""The client's picture of one conversation: the server's snapshot plus the events after it.

It never decides ownership: statuses, owner and lease come from the snapshot, the journal and
the lease frames, and every (re)connect starts again from a snapshot. The one thing it keeps of
its own is which turns this device asked, so that drafts a stop hands back reach their author.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agentd.vocabulary import (
    ACTIVE_RUN_STATUSES,
    EventType,
    MessageRole,
    MessageStatus,
    RunStatus,
)
from agenttui.client import (
    ConnectionState,
    ConnectionStatus,
    ConversationChanged,
    ConversationDeleted,
    FeedItem,
    LeaseChanged,
    PresenceChanged,
    RunStateChanged,
    Snapshot,
)
from agenttui.models import (
    Attached,
    ConversationState,
    Draft,
    Lease,
    Me,
    Message,
    MessagePage,
    Run,
    RunEvent,
    StopResult,
    parse_time,
    tool_arguments,
)

TOOL_SUMMARY_CHARS = 80


def _short_json(value: Any, limit: int = TOOL_SUMMARY_CHARS) -> str:
    # Sorted: the journal (jsonb) and the transcript (text) keep keys in different orders.
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                           sort_keys=True,
                                                           separators=(", ", ": "))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class Approval:
    """A tool call that waits for (or got) a device's decision."""

    run_id: str
    call_id: str
    tool: str
    arguments: Any
    asked_by: str | None  # the device that asked the turn
    expires_at: datetime | None = None
    decision: str | None = None  # approve | deny, None while pending
    decided_by: str | None = None
    note: str | None = None
    timed_out: bool = False

    @property
    def pending(self) -> bool:
        return self.decision is None

    def outcome(self) -> str:
        """Who decided, in words: what every attached device shows after the decision."""
        if self.decision is None:
            return f"waiting for approval (asked from {self.asked_by or 'a device'})"
        if self.timed_out:
            return "denied: nobody decided in time"
        verb = "approved" if self.decision == "approve" else "denied"
        return f"{verb} by {self.decided_by or 'a device'}" + \
            (f": {self.note}" if self.note else "")


@dataclass
class ToolStep:
    """One tool call of a turn, shown on one line."""

    call_id: str
    name: str
    arguments: Any = field(default_factory=dict)  # models.tool_arguments
    result: str | None = None
    error: str | None = None
    done: bool = False
    approval: Approval | None = None

    def summary(self) -> str:
        if isinstance(self.arguments, dict):
            args = ", ".join(f"{key}={json.dumps(value, ensure_ascii=False, sort_keys=True)}"
                             for key, value in sorted(self.arguments.items()))
        else:  # what a model sent that was no JSON object, quoted as it came
            args = json.dumps(self.arguments, ensure_ascii=False)
        args = args if len(args) <= 48 else args[:47] + "…"
        head = f"{self.name}({args})"
        if self.approval is not None and (self.approval.pending or not self.done):
            return f"{head} ⏸ {self.approval.outcome()}"
        if self.approval is not None and self.approval.decision == "approve":
            head += f" [{self.approval.outcome()}]"
        if self.error:
            return f"{head} ✗ {_short_json(self.error, 48)}"
        if self.done:
            return f"{head} → {_short_json(self.result if self.result is not None else '', 60)}"
        return f"{head} …"


def _tool_outcome(content: str) -> tuple[str | None, str | None]:
    """A tool message/event body -> (result text, error text)."""
    try:
        data = json.loads(content) if isinstance(content, str) else content
    except (ValueError, RecursionError):  # not JSON, or nested too deep to read: as it is
        return content, None
    if isinstance(data, dict):
        if "error" in data:
            return None, str(data["error"])
        if "result" in data:
            return _short_json(data["result"]), None
    return _short_json(data), None


@dataclass
class Turn:
    """A question and everything its run produced (tool steps, the answer, how it ended)."""

    key: str  # the run id (or the message id of a message without a run)
    run_id: str | None
    question: str = ""
    question_id: str | None = None
    question_status: MessageStatus | str = MessageStatus.QUEUED
    status: RunStatus | str | None = None  # None: an old turn whose run we have not looked up
    device_id: str | None = None
    worker_id: str | None = None
    lease_expires_at: datetime | None = None
    cancel_requested: bool = False
    started: bool = False
    live_text: str = ""  # the answer as streamed by content_delta events
    answer: str | None = None  # the durable answer message, once the server has one
    answer_status: MessageStatus | str | None = None
    tools: dict[str, ToolStep] = field(default_factory=dict)
    error: str | None = None
    last_seq: int = 0
    resolved: bool = False  # the run row was read (status, device, error)
    answer_id: str | None = None  # the answer's message id, once the server has one
    superseded: bool = False  # a retry or an edit replaced this exchange (kept, marked)
    usage: dict[str, Any] | None = None  # the run's token counts, once it reported them
    model: str | None = None  # the model that answered, when known
    # Its other messages: tool calls and their results (a search hit can name one).
    step_ids: set[str] = field(default_factory=set)

    @property
    def text(self) -> str:
        """What to show: the durable answer when the server has it, else the streamed text."""
        return self.answer if self.answer is not None else self.live_text

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_RUN_STATUSES

    @property
    def running(self) -> bool:
        return self.status == RunStatus.RUNNING

    @property
    def queued(self) -> bool:
        return self.status == RunStatus.QUEUED

    @property
    def finished(self) -> bool:
        return isinstance(self.status, RunStatus) and self.status.terminal


@dataclass
class Changes:
    """What an update touched, so views redraw only that."""

    turns: set[str] = field(default_factory=set)
    rebuild: bool = False  # turns were added, removed or reordered
    bar: bool = False  # ownership, presence or connection changed
    drafts: bool = False  # a draft for this device's composer is waiting
    approvals: bool = False  # a tool approval was asked or decided
    conversation: bool = False  # its title, model or archive mark changed
    deleted: bool = False  # the conversation is gone

    def merge(self, other: Changes) -> Changes:
        self.turns |= other.turns
        self.rebuild |= other.rebuild
        self.bar |= other.bar
        self.drafts |= other.drafts
        self.approvals |= other.approvals
        self.conversation |= other.conversation
        self.deleted |= other.deleted
        return self


class ConversationModel:
    """State of one conversation as this device sees it; fed by a ConversationStream."""

    def __init__(self, me: Me, conversation_id: str, *,
                 is_consumed: Callable[[str], bool] = lambda _id: False) -> None:
        self.me = me
        self.conversation_id = conversation_id
        self.title = ""
        self.model_name: str | None = None  # the conversation's model; None: the default
        self.archived_at: datetime | None = None
        self.usage: dict[str, Any] = {}  # token totals of all its runs
        self.deleted = False
        self.turns: dict[str, Turn] = {}
        self.order: list[str] = []
        self.lease: Lease | None = None
        self.attached: tuple[Attached, ...] = ()
        self.connection = ConnectionStatus(ConnectionState.CONNECTING)
        self.snapshots = 0
        self.asked_here: set[str] = set()  # run ids this device created in this session
        self.device_names: dict[str, str] = {me.device_id: me.device}
        self._is_consumed = is_consumed
        self._pending_drafts: list[Draft] = []
        self._offered: set[str] = set()
        # A paged transcript: older turns remain on the server, the next page before `before`.
        self.has_more = False
        self.before: str | None = None

    # -- feeding -----------------------------------------------------------------------------

    def apply(self, item: FeedItem) -> Changes:
        if isinstance(item, Snapshot):
            return self.apply_snapshot(item.state, resumed=item.resumed)
        if isinstance(item, RunEvent):
            return self.apply_event(item)
        if isinstance(item, LeaseChanged):
            self.lease = item.lease
            self._learn_lease()
            return Changes(bar=True)
        if isinstance(item, RunStateChanged):
            turn = self.turns.get(item.run_id)
            if turn is None or not item.cancel_requested:
                return Changes()
            turn.cancel_requested = True
            return Changes(turns={item.run_id}, bar=True)
        if isinstance(item, PresenceChanged):
            self.attached = item.attached
            self._learn_attached()
            return Changes(bar=True)
        if isinstance(item, ConversationChanged):
            return self.apply_conversation(item)
        if isinstance(item, ConversationDeleted):
            self.deleted = True
            return Changes(bar=True, deleted=True)
        if isinstance(item, ConnectionStatus):
            self.connection = item
            return Changes(bar=True)
        return Changes()

    def apply_conversation(self, item: ConversationChanged) -> Changes:
        """Title, model, archive mark, totals; turns a retry or an edit superseded."""
        changes = Changes(bar=True, conversation=(item.title, item.model, item.archived_at) != (
            self.title, self.model_name, self.archived_at))
        self.title, self.model_name, self.archived_at = item.title, item.model, item.archived_at
        self.usage = dict(item.usage)
        for key, turn in self.turns.items():
            superseded = (turn.question_id or turn.answer_id) in item.superseded
            if superseded != turn.superseded:
                turn.superseded = superseded
                changes.turns.add(key)
        return changes

    def apply_snapshot(self, state: ConversationState, *, resumed: bool) -> Changes:
        """Take the server's word for everything; keep only streamed text it cannot have yet."""
        self.snapshots += 1
        self.title = state.conversation.title
        self.model_name = state.conversation.model
        self.archived_at = state.conversation.archived_at
        self.usage = dict(state.usage)
        self.lease = state.lease
        self.attached = state.attached
        self._learn_lease()
        self._learn_attached()
        runs = {r.id: r for r in state.runs}
        old = self.turns
        turns = _group(state.messages, old, keep_stream=resumed)
        self._learn_askers(state.messages)
        for run in state.runs:  # active runs always have their question in the transcript
            turn = turns.setdefault(run.id, _fresh_from(old.get(run.id), run.id, run.id,
                                                        keep_stream=resumed))
            _take_run(turn, run)
            self._learn_device(run.device_id, run.device)
        for key, turn in turns.items():
            if key in runs:
                continue
            if turn.status in ACTIVE_RUN_STATUSES:
                turn.status = None  # it was active; the server says it no longer is
                turn.resolved = False
            _settle(turn)
        kept = self._older_than(turns) if state.has_more else {}
        if not kept:
            self.has_more, self.before = state.has_more, state.before
        turns = {**kept, **turns}
        self.turns = turns
        self.order = list(turns)
        changes = Changes(turns=set(turns), rebuild=True, bar=True)
        for turn in turns.values():
            changes.drafts |= self._offer_draft(turn)
        return changes

    def _older_than(self, page: dict[str, Turn]) -> dict[str, Turn]:
        """Turns loaded earlier (older pages) that precede a fresh newest page: kept, since
        that page does not cover them. Nothing if the page does not join what is held."""
        first = next(iter(page), None)
        if first is None or first not in self.turns:
            return {}
        kept: dict[str, Turn] = {}
        for key in self.order:
            if key == first:
                return kept
            if key not in page:
                kept[key] = self.turns[key]
        return {}

    def apply_page(self, page: MessagePage, asked_before: str) -> Changes:
        """An older page of the transcript (GET …/messages?before=`asked_before`): its turns
        go on top. Nothing when the oldest loaded turn is no longer the one it was asked
        below: a fresh snapshot that did not join what was held came meanwhile, and the page
        on top of it would hide the turns in between (the next page is asked from the new
        cursor instead)."""
        if self.before != asked_before:
            return Changes()
        grouped = _group(page.messages, {}, keep_stream=False)
        self._learn_askers(page.messages)
        new = {key: turn for key, turn in grouped.items() if key not in self.turns}
        for turn in new.values():
            _settle(turn)
        self.turns.update(new)
        self.order = list(new) + self.order
        self.has_more, self.before = page.has_more, page.before
        changes = Changes(turns=set(new), rebuild=bool(new))
        for turn in new.values():
            changes.drafts |= self._offer_draft(turn)
        return changes

    def key_of_message(self, message_id: str) -> str | None:
        """The turn holding message `message_id` (its question, answer, or a tool step's), if
        loaded."""
        for key in reversed(self.order):
            turn = self.turns[key]
            if message_id in (turn.question_id, turn.answer_id, key) or \
                    message_id in turn.step_ids:
                return key
        return None

    def apply_event(self, event: RunEvent) -> Changes:
        turn = self.turns.get(event.run_id)
        changes = Changes(turns={event.run_id})
        if turn is None:
            turn = Turn(event.run_id, event.run_id)
            self.turns[event.run_id] = turn
            self.order.append(event.run_id)
            changes.rebuild = True
        if event.seq <= turn.last_seq:
            return Changes()  # already applied (the stream drops repeats; this is a backstop)
        turn.last_seq = event.seq
        payload = event.payload
        kind = event.type
        if kind in (EventType.TOOL_CALL, EventType.TOOL_RESULT) and payload.get("message_id"):
            turn.step_ids.add(str(payload["message_id"]))  # the message a search hit names
        if kind == EventType.USER_MESSAGE:
            turn.question = str(payload.get("content") or turn.question)
            turn.question_id = str(payload.get("message_id") or turn.question_id or "") or None
            if turn.status is None:
                turn.status = RunStatus.QUEUED
        elif kind == EventType.RUN_QUEUED:
            if turn.status is None:
                turn.status = RunStatus.QUEUED
            turn.device_id = _opt(payload.get("device_id")) or turn.device_id
            self._learn_device(turn.device_id, _opt(payload.get("device")))
            changes.bar = True
        elif kind == EventType.RUN_STARTED:
            turn.status = RunStatus.RUNNING
            turn.started = True
            turn.question_status = MessageStatus.COMPLETE
            turn.worker_id = payload.get("worker_id") or turn.worker_id
            turn.lease_expires_at = parse_time(payload.get("lease_expires_at")) \
                or turn.lease_expires_at
            changes.bar = True
        elif kind == EventType.CONTENT_DELTA:
            turn.live_text += event.delta
        elif kind == EventType.TOOL_CALL:
            call_id = str(payload.get("call_id") or f"call-{event.seq}")
            step = turn.tools.setdefault(call_id, ToolStep(call_id, str(payload.get("name"))))
            step.arguments = tool_arguments(payload.get("arguments"))
        elif kind == EventType.TOOL_RESULT:
            call_id = str(payload.get("call_id") or "")
            step = turn.tools.setdefault(call_id, ToolStep(call_id, str(payload.get("name"))))
            step.done = True
            if "error" in payload:
                step.error = str(payload["error"])
            else:
                step.result = _short_json(payload.get("result"))
        elif kind == EventType.APPROVAL_REQUESTED:
            call_id = str(payload.get("call_id") or "")
            step = turn.tools.setdefault(call_id, ToolStep(call_id, str(payload.get("tool"))))
            step.approval = Approval(event.run_id, call_id, str(payload.get("tool")),
                                     payload.get("arguments"), _opt(payload.get("device")),
                                     parse_time(payload.get("expires_at")))
            changes.approvals = True
        elif kind == EventType.APPROVAL_DECIDED:
            call_id = str(payload.get("call_id") or "")
            step = turn.tools.setdefault(call_id, ToolStep(call_id, str(payload.get("tool"))))
            if step.approval is None:
                step.approval = Approval(event.run_id, call_id, str(payload.get("tool")), {},
                                         None)
            step.approval.decision = str(payload.get("decision") or "deny")
            step.approval.decided_by = _opt(payload.get("device"))
            step.approval.note = _opt(payload.get("note"))
            step.approval.timed_out = bool(payload.get("timed_out"))
            changes.approvals = True
        elif kind == EventType.CANCEL_REQUESTED:
            turn.cancel_requested = True
            changes.bar = True
        elif kind == EventType.COMPLETE:
            status = payload.get("status")
            try:
                turn.status = RunStatus(str(status))
            except ValueError:
                turn.status = str(status)
            turn.error = payload.get("error") or turn.error
            turn.resolved = True
            turn.answer_id = _opt(payload.get("message_id")) or turn.answer_id
            turn.usage = payload.get("usage") or turn.usage
            if turn.status == RunStatus.CANCELLED and not turn.started:
                # A queued turn a stop cancelled: the server made its question a draft.
                turn.question_status = MessageStatus.DRAFT
            elif turn.question_status == MessageStatus.QUEUED:
                turn.question_status = MessageStatus.COMPLETE
            if turn.answer is None and (turn.live_text or turn.status == RunStatus.COMPLETED):
                # As the server stores it: a failed turn's streamed text is kept as `failed`.
                kept: dict[str | None, MessageStatus] = {
                    RunStatus.COMPLETED: MessageStatus.COMPLETE,
                    RunStatus.FAILED: MessageStatus.FAILED}
                turn.answer_status = kept.get(turn.status, MessageStatus.PARTIAL)
            changes.bar = True
            changes.approvals = any(step.approval is not None for step in turn.tools.values())
            changes.drafts = self._offer_draft(turn)
        return changes

    def approvals(self) -> list[Approval]:
        """Approvals of the running turn: the pending ones (a prompt on every device) and the
        decided ones (every device shows who decided), in the order they were asked."""
        turn = self.running_turn
        if turn is None:
            return []
        return [step.approval for step in turn.tools.values() if step.approval is not None]

    def pending_approval(self) -> Approval | None:
        return next((a for a in self.approvals() if a.pending), None)

    def note_created(self, run_id: str) -> None:
        """This device asked for `run_id` (from the create-run answer)."""
        self.asked_here.add(run_id)
        turn = self.turns.get(run_id)
        if turn is not None and turn.device_id is None:
            turn.device_id = self.me.device_id

    def _learn_askers(self, messages: Iterable[Message]) -> None:
        for message in messages:
            self._learn_device(message.device_id, message.device)

    def _learn_device(self, device_id: str | None, name: str | None) -> None:
        if device_id and name:
            self.device_names[device_id] = name

    def note_run(self, run: Run) -> Changes:
        """What a run row says (read for turns whose device or ending is not known yet)."""
        turn = self.turns.get(run.id)
        if turn is None:
            return Changes()
        turn.resolved = True
        turn.device_id = run.device_id or turn.device_id
        self._learn_device(run.device_id, run.device)
        if run.terminal or turn.status is None:
            turn.status = run.status
        turn.error = run.error or turn.error
        turn.worker_id = turn.worker_id or run.worker_id
        turn.usage = turn.usage or run.usage
        turn.model = turn.model or run.model
        return Changes(turns={run.id}, bar=True, drafts=self._offer_draft(turn))

    def note_stop(self, result: StopResult) -> Changes:
        """The answer to this device's stop: mark the flagged turns, keep this device's drafts."""
        changes = Changes(bar=True)
        for run_id in result.flagged:
            turn = self.turns.get(run_id)
            if turn is not None and not turn.finished:
                turn.cancel_requested = True
                changes.turns.add(run_id)
        for draft in result.drafts:
            if self._mine(draft.run_id) and draft.message_id not in self._offered \
                    and not self._is_consumed(draft.message_id):
                self._offered.add(draft.message_id)
                self._pending_drafts.append(draft)
                changes.drafts = True
        return changes

    def runs_to_resolve(self, limit: int = 20) -> list[str]:
        """Recent turns whose author or ending only the run row can tell."""
        wanted = []
        for key in reversed(self.order):
            turn = self.turns[key]
            if turn.run_id is None or turn.resolved:
                continue
            unknown_author = turn.device_id is None and turn.run_id not in self.asked_here
            unknown_end = turn.status is None
            if unknown_author or unknown_end:
                wanted.append(turn.run_id)
            if len(wanted) >= limit:
                break
        return wanted

    def take_drafts(self) -> list[Draft]:
        """Drafts to put back in this device's composer (each offered once), in the order
        their turns were queued (a stop's answer lists them in no particular order)."""
        drafts, self._pending_drafts = self._pending_drafts, []
        position = {key: index for index, key in enumerate(self.order)}
        return sorted(drafts, key=lambda draft: position.get(draft.run_id, len(position)))

    # -- reading -----------------------------------------------------------------------------

    def turn_list(self) -> list[Turn]:
        return [self.turns[key] for key in self.order]

    @property
    def running_turn(self) -> Turn | None:
        return next((t for t in self.turn_list() if t.running), None)

    @property
    def queued_turns(self) -> list[Turn]:
        return [t for t in self.turn_list() if t.queued]

    def queue_position(self, turn: Turn) -> int | None:
        queued = self.queued_turns
        return queued.index(turn) + 1 if turn in queued else None

    @property
    def state(self) -> str:
        """idle · queued n · running · cancelling (as the server's rows and events say)."""
        running = self.running_turn
        if running is not None:
            return "cancelling" if running.cancel_requested else "running"
        queued = len(self.queued_turns)
        return f"queued {queued}" if queued else "idle"

    def device_name(self, device_id: str | None) -> str | None:
        if device_id is None:
            return None
        return self.device_names.get(device_id)

    def owner(self) -> tuple[str | None, str | None, str | None, datetime | None]:
        """(run id, asking device name, worker id, lease deadline) of the running turn."""
        turn = self.running_turn
        lease = self.lease
        if turn is None:
            return None, None, None, None
        if lease is not None and lease.run_id == turn.run_id:
            device = lease.device or self.device_name(lease.device_id)
            return turn.run_id, device, lease.worker_id, lease.expires_at
        device_id = turn.device_id or (self.me.device_id if turn.run_id in self.asked_here
                                       else None)
        return turn.run_id, self.device_name(device_id), turn.worker_id, turn.lease_expires_at

    def owner_is_me(self) -> bool:
        turn = self.running_turn
        if turn is None:
            return False
        if self.lease is not None and self.lease.run_id == turn.run_id and self.lease.device_id:
            return self.lease.device_id == self.me.device_id
        return self._mine(turn.run_id)

    def last_answer(self) -> str | None:
        for turn in reversed(self.turn_list()):
            if turn.text:
                return turn.text
        return None

    def mine(self, turn: Turn) -> bool:
        return self._mine(turn.run_id)

    # -- internals ---------------------------------------------------------------------------

    def _mine(self, run_id: str | None) -> bool:
        if run_id is None:
            return False
        if run_id in self.asked_here:
            return True
        turn = self.turns.get(run_id)
        return turn is not None and turn.device_id == self.me.device_id

    def _offer_draft(self, turn: Turn) -> bool:
        if turn.question_status != MessageStatus.DRAFT or not turn.question_id \
                or turn.run_id is None or not self._mine(turn.run_id):
            return False
        if turn.question_id in self._offered or self._is_consumed(turn.question_id):
            return False
        self._offered.add(turn.question_id)
        self._pending_drafts.append(Draft(turn.run_id, turn.question_id, turn.question))
        return True

    def _learn_lease(self) -> None:
        lease = self.lease
        if lease is not None and lease.device_id and lease.device:
            self.device_names[lease.device_id] = lease.device
        if lease is not None:
            turn = self.turns.get(lease.run_id)
            if turn is not None and lease.device_id:
                turn.device_id = lease.device_id

    def _learn_attached(self) -> None:
        for item in self.attached:
            self.device_names[item.device_id] = item.device


def _group(messages: Iterable[Message], old: dict[str, Turn], *,
           keep_stream: bool) -> dict[str, Turn]:
    """Messages in turn order -> turns: a question and everything its run wrote."""
    turns: dict[str, Turn] = {}
    key = ""
    for message in messages:
        # A message of no run (a fork's copy) belongs with the question before it.
        if message.run_id or message.role == MessageRole.USER or not key:
            key = message.run_id or message.id
        turn = turns.get(key)
        if turn is None:
            turn = _fresh_from(old.get(key), key, message.run_id, keep_stream=keep_stream)
            turns[key] = turn
        _take_message(turn, message)
    return turns


def _settle(turn: Turn) -> None:
    """What the messages of a turn with no active run say about how it ended."""
    if turn.status is None and turn.answer_status == MessageStatus.COMPLETE:
        turn.status = RunStatus.COMPLETED
    if turn.question_status == MessageStatus.DRAFT and turn.status is None:
        turn.status = RunStatus.CANCELLED


def _fresh_from(old: Turn | None, key: str, run_id: str | None, *, keep_stream: bool) -> Turn:
    """A turn rebuilt from a snapshot, carrying over what only this client knows."""
    turn = Turn(key, run_id)
    if old is not None:
        turn.device_id = old.device_id
        turn.resolved = old.resolved
        if old.finished:
            turn.status, turn.error = old.status, old.error
            turn.started = old.started
        if keep_stream:
            # Resumed from a cursor: the feed continues after what was streamed already.
            turn.live_text = old.live_text
            turn.last_seq = old.last_seq
            turn.tools = old.tools
            turn.started = old.started
            turn.worker_id = old.worker_id
            turn.lease_expires_at = old.lease_expires_at
            turn.status = old.status
            turn.error = old.error
            turn.cancel_requested = old.cancel_requested
    return turn


def _take_message(turn: Turn, message: Message) -> None:
    if message.role == MessageRole.USER:
        turn.question = message.content
        turn.question_id = message.id
        turn.device_id = message.device_id or turn.device_id
        turn.question_status = message.status
        turn.superseded = message.superseded_by is not None
        if message.status == MessageStatus.COMPLETE:
            turn.started = True
    elif message.role == MessageRole.ASSISTANT and message.tool_calls:
        turn.step_ids.add(message.id)
        for call in message.tool_calls:
            step = turn.tools.setdefault(call.id, ToolStep(call.id, call.name))
            step.arguments = tool_arguments(call.arguments)
    elif message.role == MessageRole.ASSISTANT:
        turn.answer = message.content
        turn.answer_status = message.status
        turn.answer_id = message.id
        turn.usage = message.usage or turn.usage
        turn.model = message.model or turn.model
        turn.superseded = turn.superseded or message.superseded_by is not None
    elif message.role == MessageRole.TOOL and message.tool_call_id:
        turn.step_ids.add(message.id)
        step = turn.tools.setdefault(message.tool_call_id,
                                     ToolStep(message.tool_call_id, "tool"))
        step.done = True
        result, error = _tool_outcome(message.content)
        if message.status == MessageStatus.CANCELLED:
            error = error or "cancelled"
        step.result, step.error = result, error


def _take_run(turn: Turn, run: Run) -> None:
    turn.status = run.status
    turn.device_id = run.device_id or turn.device_id
    turn.cancel_requested = run.cancel_requested or turn.cancel_requested
    turn.worker_id = run.worker_id or turn.worker_id
    turn.lease_expires_at = run.lease_expires_at or turn.lease_expires_at
    turn.error = run.error
    turn.resolved = True
    if run.status == RunStatus.RUNNING:
        turn.started = True


def turns_text(turns: Iterable[Turn]) -> str:
    """The visible transcript as plain text (for debugging and tests)."""
    out = []
    for turn in turns:
        out.append(f"> {turn.question}")
        if turn.text:
            out.append(turn.text)
    return "\n\n".join(out)


def _opt(value: Any) -> str | None:
    return str(value) if value else None
