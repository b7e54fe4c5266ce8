"""Runs one claimed turn: model stream ⇄ tools, journaled behind the fence, finalized once.

The process's heartbeat (heartbeat.LeaseKeeper) keeps the lease and reports the cancel flag and a
lost lease; on LeaseLost everything stops and nothing more is written. A turn is bounded: past
max_run_s it ends `failed` with `deadline_exceeded`, and each model call past its provider's
call_timeout_s with `provider_timeout`. A failed turn keeps the text it streamed
(finish_runs stores the journal's text with status `failed`); clients get a stable code
and a short message (failures.py), the log gets the detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar
from uuid import UUID, uuid4

import asyncpg

from agentd.approvals import (
    Decision,
    DuplicateCall,
    Waiting,
    expire_approval,
    read_approval,
    request_approval,
)
from agentd.db import DB_ERRORS, NOT_SENT
from agentd.failures import RunFailure, classify, failure, log_failure
from agentd.heartbeat import HeldRun, LeaseKeeper
from agentd.hub import Hub, Subscription
from agentd.journal import RETRY_DELAYS_S, TRANSIENT, Emitter
from agentd.metrics import Metrics
from agentd.pgtext import clean, clean_text
from agentd.providers import ModelRef, ProviderRegistry, parse_model
from agentd.providers.base import (
    ProviderError,
    TextDelta,
    ToolCallRequest,
    Usage,
)
from agentd.queue import (
    Appends,
    Claim,
    Event,
    Finishes,
    Hint,
    LeaseLost,
    answer_open_tool_calls,
    check_lease,
    ended_after_lost_answer,
    finish_run_journaled,
    insert_message,
    open_turn,
)
from agentd.settings import Settings
from agentd.tools import Tool, ToolContext, ToolError, ToolRegistry
from agentd.tools.store import DatabaseToolStore
from agentd.vocabulary import (
    ApprovalDecision,
    ApprovalPolicy,
    Channel,
    EventType,
    MessageRole,
    MessageStatus,
    RunErrorCode,
    RunStatus,
)

log = logging.getLogger("agentd.executor")

# Errors after which a write certainly did not commit: nothing answered is in doubt.
_ROLLED_BACK = (asyncpg.exceptions.DeadlockDetectedError,
                asyncpg.exceptions.LockNotAvailableError, *NOT_SENT)
# What the model reads for a call a stop caught while it waited for a device's approval.
NOT_RUN_STOPPED = "not run: the turn was stopped while the call waited for approval"


@dataclass(frozen=True)
class Journaled:
    """Where a turn's committed journal rows go in this process, the hint that follows, and
    who is told when the turn is over here (its rows are let go then: its `complete` is
    written by the terminal write's SQL, never handed over)."""

    rows: Callable[[UUID, Sequence[Event]], None]
    hint: Hint
    ended: Callable[[UUID], None]


class TooManyToolSteps(ProviderError):
    def __init__(self, message: str) -> None:
        super().__init__(message, RunErrorCode.TOOL_STEPS_EXCEEDED)


@dataclass
class _Turn:
    """What one execution has produced so far (kept on cancel or failure)."""

    claim: Claim
    emitter: Emitter
    held: HeldRun
    max_run_s: float
    transcript: list[dict[str, Any]] = field(default_factory=list)  # what the model reads first
    started: float = field(default_factory=time.monotonic)
    text: list[str] = field(default_factory=list)
    open_calls: dict[str, str] = field(default_factory=dict)  # call id -> tool name
    awaiting: set[str] = field(default_factory=set)  # open calls waiting for an approval
    asked: set[str] = field(default_factory=set)  # call ids a device was asked about
    # A person's time is not the turn's: waits for an approval stop its max_run_s clock, for
    # at most this long in all (approval_timeout_s), so a turn still ends within max_run_s +
    # approval_timeout_s however many calls it asks about.
    max_pause_s: float = 0.0
    paused_s: float = 0.0  # spent in approval waits that are over
    waiting_since: float | None = None  # when the approval wait under way began
    asked_tools: bool = False  # a tool-call message may have been written
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def answer(self) -> str:
        return "".join(self.text)

    @property
    def usage(self) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def deadline_left(self) -> float:
        """Seconds of max_run_s left (never negative), approval waits not counted (up to
        max_pause_s in all). It never shrinks faster than the clock: a wait for it to pass
        that ends early (the clock stood still) is simply made again."""
        now = time.monotonic()
        waiting = now - self.waiting_since if self.waiting_since is not None else 0.0
        paused = min(self.paused_s + waiting, self.max_pause_s)
        return max(0.0, self.max_run_s - (now - self.started - paused))

    @contextlib.contextmanager
    def waiting_for_a_person(self) -> Iterator[None]:
        """The max_run_s clock stands still inside (an approval wait)."""
        self.waiting_since = time.monotonic()
        try:
            yield
        finally:
            self.paused_s += time.monotonic() - self.waiting_since
            self.waiting_since = None


class TurnRunner:
    """Executes claims for one worker; `run` returns True once the terminal write landed."""

    def __init__(self, pool: asyncpg.Pool, hub: Hub, keeper: LeaseKeeper, settings: Settings,
                 providers: ProviderRegistry, tools: ToolRegistry,
                 hint: Hint | None = None, metrics: Metrics | None = None,
                 finishes: Finishes | None = None,
                 appends: Appends | None = None,
                 journaled: Journaled | None = None) -> None:
        """`journaled`: the process's tails are handed each journal batch's rows, then woken
        with `journaled.hint` (shared_reads.py); without it they read them back."""
        self._pool = pool
        self._journaled = journaled
        # Journal and terminal writes of concurrent turns share commits (group_commit.py).
        self._finishes = finishes
        self._appends = appends
        self._hint = hint
        self._hub = hub
        self._keeper = keeper
        self._metrics = metrics or Metrics()
        self._settings = settings
        self._providers = providers
        self._tools = tools
        self._tool_store = DatabaseToolStore(pool)

    async def run(self, claim: Claim) -> bool:
        ctx = {"run_id": str(claim.run_id), "fence": claim.fence}
        # Held before the first read, so a stop committed in between still reaches us (the
        # heartbeat listens for stops of every run it holds).
        held = self._keeper.hold(claim)
        try:
            transcript: Sequence[Mapping[str, Any] | asyncpg.Record] | None = claim.transcript
            try:
                # A claim beside its post read the transcript in the post's own statement,
                # moments ago: nothing to read (the lease is as fresh as a read would find it,
                # every write is fenced anyway, and a stop committed since is a hint the
                # keeper remembered for it: heartbeat.py). Any other claim may have been
                # granted a while ago, so the lease must still be live before any work starts
                # (docs/architecture.md, lease and fence). A read, not a renewal: the claim
                # granted a full lease, and a write here would put one more synchronous commit
                # in front of every turn. One round trip with the transcript.
                if transcript is None:
                    # A dropped connection here (a pooled one whose server went away) is
                    # retried as every later write of the turn is: it is only a read.
                    beat, rows = await _retried(open_turn, self._pool, claim,
                                                what="the turn's opening read")
                    transcript = rows
                    if beat.cancel_requested:
                        held.cancel.set()
            except LeaseLost:
                log.warning("lease gone before the turn started; standing down", extra=ctx)
                return False
            told = self._journaled
            emitter = Emitter(self._pool, claim,
                              flush_interval_s=self._settings.flush_ms / 1000,
                              hint=told.hint if told is not None else self._hint,
                              appends=self._appends,
                              journaled=told.rows if told is not None else None)
            turn = _Turn(claim, emitter, held, self._settings.max_run_s,
                         transcript=[_chat_message(r) for r in transcript],
                         max_pause_s=self._settings.approval_timeout_s)
            try:
                return await self._execute(turn, held.cancel, held.lost, ctx)
            except LeaseLost as exc:
                if emitter.lost is not None or exc.action != "heartbeat":
                    self._metrics.fenced_writes.inc()  # a write was refused, not only a beat
                log.warning("lease lost; stopped and wrote nothing more",
                            extra={**ctx, "during": exc.action})
                return False
        finally:
            self._keeper.release(claim.run_id)
            if self._journaled is not None:
                self._journaled.ended(claim.run_id)

    async def _execute(self, turn: _Turn, cancel: asyncio.Event, lost: asyncio.Event,
                       ctx: dict[str, Any]) -> bool:
        claim, emitter = turn.claim, turn.emitter  # the claim itself journaled run_started
        log.info("run started", extra=ctx)
        generating = asyncio.create_task(self._generate(turn))
        stops = [asyncio.create_task(cancel.wait()), asyncio.create_task(lost.wait())]
        try:
            done: set[asyncio.Task[Any]] = set()
            while not done and turn.deadline_left() > 0:
                # Past this timeout the deadline may have moved on (an approval wait stopped
                # the clock meanwhile): the loop looks again, at least a second later while a
                # wait holds the clock still (whatever little was left when it began).
                timeout = turn.deadline_left()
                if turn.waiting_since is not None:
                    timeout = max(timeout, 1.0)
                done, _ = await asyncio.wait([generating, *stops], timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in stops:
                task.cancel()
            if not generating.done():
                # Closes the provider stream at once: no tokens keep being paid for.
                generating.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await generating
        if lost.is_set() or emitter.lost is not None:
            raise emitter.lost or LeaseLost(claim.run_id, "heartbeat")
        if cancel.is_set() and not _finished_ok(generating):
            await self._repair_open_calls(turn)
            await emitter.event(EventType.CANCEL_REQUESTED, {"partial": bool(turn.text)})
            return await self._finish(turn, RunStatus.CANCELLED, None, ctx)
        if not done:
            # Past max_run_s: the stream is closed, what it said is kept, the calls repaired.
            ended = failure(RunErrorCode.DEADLINE_EXCEEDED)
            self._metrics.deadline_failures.inc()
            log_failure(claim.run_id, ended, None, max_run_s=self._settings.max_run_s)
            await self._repair_open_calls(turn)
            return await self._finish(turn, RunStatus.FAILED, ended, ctx)
        if generating.cancelled():
            await self._repair_open_calls(turn)
            return await self._finish(turn, RunStatus.CANCELLED, None, ctx)
        error = generating.exception()
        if isinstance(error, LeaseLost):
            raise error
        if error is not None and not isinstance(error, ProviderError) and \
                await self._disowned(claim):
            # A write that failed because the run is gone (its conversation was deleted, a
            # foreign key says so) is a lost lease, not a crash: stop quietly.
            raise LeaseLost(claim.run_id, f"turn step ({type(error).__name__})") from error
        if error is not None:
            ended = classify(error)
            log_failure(claim.run_id, ended, error, fence=claim.fence)
            await self._repair_open_calls(turn)
            return await self._finish(turn, RunStatus.FAILED, ended, ctx)
        return await self._finish(turn, RunStatus.COMPLETED, None, ctx)

    async def _ended_by_lost_write(self, claim: Claim, shown: tuple[str, str | None]) -> bool:
        """Whether the run ended with the status and error code a terminal write whose answer
        was lost meant to give it (its ending's wake-ups are sent if it ended at all)."""
        try:
            ending = await ended_after_lost_answer(self._pool, claim, self._hint)
        except DB_ERRORS:
            return False  # nothing known: the refusal stands
        return ending is not None and (str(ending.status), ending.error_code) == shown

    async def _disowned(self, claim: Claim) -> bool:
        """Whether this execution no longer owns its run (a failed read says nothing)."""
        try:
            await check_lease(self._pool, claim)
        except LeaseLost:
            return True
        except DB_ERRORS:
            return False
        return False

    async def _finish(self, turn: _Turn, status: RunStatus, ended: RunFailure | None,
                      ctx: dict[str, Any]) -> bool:
        # The last deltas ride in the terminal write's transaction: one commit ends the turn.
        last = await turn.emitter.hand_over()
        answer = turn.answer
        complete = status == RunStatus.COMPLETED
        turn.held.finishing = True  # a beat that finds the run ended from here on is no news
        shown: tuple[str, str | None] = (str(status), ended.code if ended else None)
        uncertain = False  # an attempt failed on the wire, and may have committed
        shared = self._finishes  # None: written alone (this run's row was held)
        for attempt in range(len(RETRY_DELAYS_S) + 1):
            try:
                await finish_run_journaled(
                    self._pool, turn.claim, status, last=last, seq=turn.emitter.next_seq,
                    # A failed turn's answer is its journal's text, taken by the terminal
                    # write itself.
                    content=answer if (answer or complete) else None,
                    message_status=MessageStatus.COMPLETE if complete else MessageStatus.PARTIAL,
                    hint=self._hint, error=ended.message if ended else None,
                    error_code=ended.code if ended else None, usage=turn.usage,
                    finishes=shared)
                break
            except LeaseLost:
                # A retry refused after an attempt whose answer was lost: that attempt may
                # have ended the run. If the run ended as this write ends it, it did: the turn
                # is finished, and the ending's wake-ups, which the lost answer never sent, go
                # now (the conversation's next turn and its readers need not wait for their
                # polls). Ended otherwise (a finalizer), the lease was lost, as reported.
                if not (uncertain and await self._ended_by_lost_write(turn.claim, shown)):
                    raise
                break
            except TRANSIENT as exc:
                # Rolled back, or committed with the answer lost on the wire: a retry either
                # lands or is refused by its fence (above).
                if attempt == len(RETRY_DELAYS_S):
                    raise
                uncertain = uncertain or not isinstance(exc, _ROLLED_BACK)
                if isinstance(exc, asyncpg.exceptions.LockNotAvailableError):
                    shared = None  # as the journal's retries (journal.Emitter._append)
                await asyncio.sleep(RETRY_DELAYS_S[attempt])
        self._metrics.run_seconds.labels(status=shown[0]).observe(turn.elapsed())
        log.info("run finished", extra={**ctx, "status": shown[0], "error_code": shown[1],
                                        "journal_rows": turn.emitter.rows_written})
        return True

    async def _generate(self, turn: _Turn) -> None:
        claim = turn.claim
        request = claim.request
        ref = parse_model(request.get("model"), self._settings)
        provider = self._providers.resolve(ref)
        params = dict(request.get("params") or {})
        messages = list(turn.transcript)
        specs = await self._tools.specs()
        call_timeout_s = self._settings.providers[ref.provider].call_timeout_s
        for step in range(self._settings.max_tool_steps + 1):
            calls: list[ToolCallRequest] = []
            said_before = len(turn.text)
            # aclosing: a cancel landing while we journal a delta still closes the provider's
            # stream (and its upstream connection) at once, not when the generator is collected.
            stream = provider.stream(ref.model, messages, specs, params)
            bound = asyncio.timeout(call_timeout_s)
            try:
                async with bound, contextlib.aclosing(stream):
                    async for item in stream:
                        if isinstance(item, TextDelta):
                            # PostgreSQL text and jsonb cannot hold NUL (nor a lone
                            # surrogate): the answer is built from what the journal holds.
                            text = clean_text(item.text)
                            if not text:
                                continue
                            if not turn.text:
                                self._metrics.first_token.observe(turn.elapsed())
                            turn.text.append(text)
                            await turn.emitter.delta(text)
                        elif isinstance(item, ToolCallRequest):
                            calls.append(item)
                        elif isinstance(item, Usage):
                            turn.input_tokens += item.input_tokens
                            turn.output_tokens += item.output_tokens
            except TimeoutError:
                if not bound.expired():
                    raise
                raise ProviderError(f"{ref}: one model call took longer than "
                                    f"providers.{ref.provider}.call_timeout_s "
                                    f"({call_timeout_s:g} s)",
                                    RunErrorCode.PROVIDER_TIMEOUT) from None
            if not calls:
                return
            if step == self._settings.max_tool_steps:
                break  # one step too many: refuse it rather than run it
            # What the model said in this step goes back to it with its calls: its next step
            # reads that it said it (the stored answer keeps the whole turn's text, as
            # streamed, so the transcript's shape is unchanged).
            said = "".join(turn.text[said_before:])
            messages.extend(await self._run_tools(turn, ref, calls, said))
        raise TooManyToolSteps(f"more than {self._settings.max_tool_steps} tool steps in one turn")

    async def _run_tools(self, turn: _Turn, ref: ModelRef, calls: list[ToolCallRequest],
                         said: str) -> list[dict[str, Any]]:
        claim = turn.claim
        wire_calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
        turn.asked_tools = True
        asked_id = uuid4()
        await _retried(insert_message, self._pool, claim, role=MessageRole.ASSISTANT,
                       content="", tool_calls=wire_calls, message_id=asked_id)
        added: list[dict[str, Any]] = [{"role": "assistant", "content": said,
                                        "tool_calls": wire_calls}]
        ctx = ToolContext(claim.run_id, claim.conversation_id, claim.account_id, claim.fence,
                          self._tool_store)
        for call in calls:
            turn.open_calls[call.id] = call.name
            # Each event names the message it is stored in: a search hit names that message.
            await turn.emitter.event(EventType.TOOL_CALL, {
                "call_id": call.id, "name": call.name, "arguments": call.arguments,
                "message_id": str(asked_id)})
            result = await self._run_tool(turn, call, ctx)
            content = json.dumps(clean(result), default=str)
            result_id = uuid4()
            await _retried(insert_message, self._pool, claim, role=MessageRole.TOOL,
                           content=content, tool_call_id=call.id, message_id=result_id)
            del turn.open_calls[call.id]
            await turn.emitter.event(EventType.TOOL_RESULT, {
                **json.loads(content), "call_id": call.id, "name": call.name,
                "message_id": str(result_id)})
            added.append({"role": "tool", "content": content, "tool_call_id": call.id})
        return added

    async def _run_tool(self, turn: _Turn, call: ToolCallRequest,
                        ctx: ToolContext) -> dict[str, Any]:
        """One call, as the model will read it: {"result": …} or {"error": …}. Arguments are
        checked before anyone is asked; `ask` waits for a device, `deny` never runs."""
        try:
            tool = await self._tools.find(call.name)
            if tool is None:
                raise ToolError(f"unknown tool {call.name!r}")
            if tool.policy == ApprovalPolicy.DENY:
                raise ToolError(f"not run: the approval policy of {tool.name} is deny")
            args = tool.check_arguments(call.arguments)
            if tool.policy == ApprovalPolicy.ASK:
                decision = await self._ask(turn, call, tool, args)
                if decision.decision != ApprovalDecision.APPROVE:
                    raise ToolError(self._denial(decision))
            return {"result": await tool.fn(args, ctx)}  # checked above, once
        except ToolError as exc:
            return {"error": str(exc)}

    async def _ask(self, turn: _Turn, call: ToolCallRequest, tool: Tool,
                   args: dict[str, Any]) -> Decision:
        """Journal approval_requested and wait (lease kept by the heartbeat) until a device
        decides or the deadline passes; journal approval_decided. A stop or a lost lease
        cancels the whole turn task, and with it this wait."""
        claim = turn.claim
        duplicate = ToolError(f"not run: the call id {call.id!r} was already used in this turn")
        if call.id in turn.asked:
            # Told here, so the database's answer to the same call id and arguments again can
            # only be this call's own retry after a lost answer (request_approval).
            raise duplicate
        turn.asked.add(call.id)
        # Subscribe before asking, so a decision committed right after the question still wakes us.
        async with self._hub.subscribe(Channel.APPROVAL, str(claim.run_id)) as decided:
            try:
                asked = await _retried(
                    request_approval, self._pool, claim, call_id=call.id, tool=tool.name,
                    arguments=args, timeout_s=self._settings.approval_timeout_s)
            except DuplicateCall:
                raise duplicate from None
            turn.awaiting.add(call.id)
            await turn.emitter.event(EventType.APPROVAL_REQUESTED, {
                "call_id": call.id, "tool": tool.name, "arguments": args,
                "device": asked.device,
                "device_id": str(asked.device_id) if asked.device_id else None,
                "expires_at": _rfc3339(asked.expires_at),
                "timeout_s": self._settings.approval_timeout_s})
            with turn.waiting_for_a_person():
                decision = await self._await_decision(claim, call.id, decided)
            await turn.emitter.event(EventType.APPROVAL_DECIDED, {
                "call_id": call.id, "tool": tool.name, "decision": str(decision.decision),
                "device": decision.device,
                "device_id": str(decision.device_id) if decision.device_id else None,
                "note": decision.note, "timed_out": decision.timed_out})
            turn.awaiting.discard(call.id)
            return decision

    async def _await_decision(self, claim: Claim, call_id: str,
                              decided: Subscription) -> Decision:
        """Rows are truth: re-read the approval on every hint and on a poll clock; past its
        deadline (database clock), deny it as timed out through the one-decision guard."""
        while True:
            decided.clear()
            try:
                state = await read_approval(self._pool, claim.run_id, call_id)
                if isinstance(state, Decision):
                    return state
                if state is None:
                    raise LeaseLost(claim.run_id, "approval wait")
                if state.seconds_left <= 0:
                    note = f"no device decided within {self._settings.approval_timeout_s:g} s"
                    if not await expire_approval(self._pool, claim, call_id=call_id, note=note):
                        await check_lease(self._pool, claim)  # LeaseLost, or decided first
                    continue
            except DB_ERRORS as exc:
                log.warning("approval read failed; retrying",
                            extra={"run_id": str(claim.run_id), "error": str(exc)})
                state = Waiting(1.0)
            poll = 1.0 if not self._hub.connected else 5.0
            await decided.wait(min(state.seconds_left, poll))

    @staticmethod
    def _denial(decision: Decision) -> str:
        if decision.timed_out:
            return f"not run: {decision.note or 'the approval timed out'}, so it was denied"
        who = decision.device or "a device"
        return f"not run: denied by {who}" + (f": {decision.note}" if decision.note else "")

    async def _repair_open_calls(self, turn: _Turn) -> None:
        """A tool call without a result gets a `cancelled` one: the next request stays valid.

        The messages come from the database's one repair (every unanswered call of the run,
        even one cancelled before it was announced); the stream gets a tool_result for each
        call it saw announced.
        """
        not_run = json.dumps({"error": NOT_RUN_STOPPED})
        for call_id in sorted(turn.awaiting):
            # It never ran: say so, rather than the generic "cancelled" of the repair below.
            await _retried(insert_message, self._pool, turn.claim, role=MessageRole.TOOL,
                           content=not_run, status=MessageStatus.CANCELLED,
                           tool_call_id=call_id, message_id=uuid4())
        if turn.asked_tools:
            await _retried(answer_open_tool_calls, self._pool, turn.claim)
        for call_id, name in list(turn.open_calls.items()):
            error = NOT_RUN_STOPPED if call_id in turn.awaiting else "cancelled"
            await turn.emitter.event(EventType.TOOL_RESULT, {
                "call_id": call_id, "name": name, "error": error})
            del turn.open_calls[call_id]
        turn.awaiting.clear()


_T = TypeVar("_T")


async def _retried(write: Callable[..., Awaitable[_T]], *args: Any,
                   what: str = "a tool step's write", **kwargs: Any) -> _T:
    """A turn's opening read or a tool step's write, run again after a dropped connection, a
    deadlock or a lock wait in vain, as journal appends are (the fence decides whether a retry
    may still write). Each such write is idempotent: a message carries its own id, an approval
    its call id, and the repair answers only what is still open, so an attempt whose answer
    was lost is found, not doubled."""
    for delay in RETRY_DELAYS_S:
        try:
            return await write(*args, **kwargs)
        except TRANSIENT as exc:
            log.info(f"{what} failed; retrying",
                     extra={"error": str(exc) or type(exc).__name__, "retry_s": delay})
        await asyncio.sleep(delay)
    return await write(*args, **kwargs)


def _rfc3339(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _finished_ok(task: asyncio.Task[None]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


def _chat_message(row: Mapping[str, Any] | asyncpg.Record) -> dict[str, Any]:
    message: dict[str, Any] = {"role": row["role"], "content": row["content"]}
    if row["tool_calls"]:
        message["tool_calls"] = row["tool_calls"]
    if row["tool_call_id"]:
        message["tool_call_id"] = row["tool_call_id"]
    return message

