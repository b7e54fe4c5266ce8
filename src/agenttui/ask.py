"""`agenttui ask`: queue one turn and stream its answer to stdout, for scripts.

stdout gets exactly the answer text (plus a final newline on a terminal); everything else goes
to stderr. On a terminal, control characters in the model's text are dropped (`--raw` keeps
them): a model must not move the cursor, retitle the window or rewrite the screen. Ctrl-C asks
the server to stop the run — a disconnect alone would not stop it — and waits for the run to
end; a second Ctrl-C leaves at once.

A tool call that needs approval is asked about on the terminal (y/N on stderr, answer on stdin);
when stdin is not a terminal it is denied, unless --approve-all says to allow every call (said
loudly on stderr). Another device may decide first: its decision is shown and the question
withdrawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import sys
import termios
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from agentd.vocabulary import EventType, RunStatus
from agenttui.client import (
    AgentClient,
    ApiError,
    Conflict,
    ConnectionState,
    ConnectionStatus,
    describe,
)
from agenttui.models import CreatedRun, RunEvent

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CANCELLED = 3
EXIT_UNREACHABLE = 4
EXIT_INTERRUPTED = 130

TITLE_CHARS = 60

# C0 controls except newline and tab, DEL, and the C1 controls (U+0080-U+009F): the characters
# a terminal acts on instead of showing. Without ESC and CSI no escape sequence can start.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def without_controls(text: str) -> str:
    """`text` with every control character but newline and tab removed."""
    return _CONTROLS.sub("", text)


@dataclass
class AskOutcome:
    status: RunStatus | str | None
    run_id: str | None
    conversation_id: str | None
    error: str | None
    interrupted: bool
    note: str | None = None  # what `report` says instead of its usual line

    @property
    def exit_code(self) -> int:
        if self.status == RunStatus.COMPLETED:
            return EXIT_COMPLETED
        if self.status == RunStatus.CANCELLED:
            return EXIT_INTERRUPTED if self.interrupted else EXIT_CANCELLED
        return EXIT_FAILED


async def resolve_conversation(client: AgentClient, conversation: str | None,
                               text: str, model: str | None = None) -> tuple[str, bool]:
    """(conversation id, created?) for --conversation ID | last | (none: a new one, whose
    later turns keep using `model`)."""
    if conversation == "last":
        items = await client.list_conversations(limit=1)
        if items:
            return items[0].id, False
        conversation = None
    if conversation:
        return conversation, False
    title = " ".join(text.split())
    if len(title) > TITLE_CHARS:
        title = title[: TITLE_CHARS - 1] + "…"
    return (await client.create_conversation(title, model=model)).id, True


@dataclass(frozen=True)
class _Screens:
    """Which of stdout / stderr is a terminal that must only get printable model text."""

    out: bool
    err: bool


@dataclass
class Approver:
    """How `ask` answers tool approvals: prompt on a terminal, deny without one, or (scripts
    that asked for it) approve everything."""

    approve_all: bool = False
    stdin: TextIO = field(default_factory=lambda: sys.stdin)

    async def decide(self, payload: dict[str, Any], err: TextIO) -> tuple[str, str | None]:
        """(approve | deny, note) for one approval_requested payload."""
        tool = without_controls(str(payload.get("tool")))
        arguments = json.dumps(payload.get("arguments"), ensure_ascii=True, sort_keys=True)
        if self.approve_all:
            print(f"agenttui: APPROVING {tool} {arguments} without asking (--approve-all)",
                  file=err, flush=True)
            return "approve", "approved by --approve-all"
        if not _is_terminal(self.stdin):
            print(f"agenttui: denied {tool} {arguments}: stdin is not a terminal to ask on "
                  f"(--approve-all allows every tool call)", file=err, flush=True)
            return "deny", "agenttui ask: no terminal to ask on"
        asked = payload.get("device") or "a device"
        _discard_typed_ahead(self.stdin)
        # The prompt goes to a terminal: names from a tool server or a device stay printable.
        err.write(without_controls(f"agenttui: the model wants to run {tool} {arguments} "
                                   f"(asked from {asked}). Allow it? [y/N] "))
        err.flush()
        line = await _read_line(self.stdin)
        return ("approve", None) if line.strip().lower() in ("y", "yes") else ("deny", None)


def _discard_typed_ahead(stream: TextIO) -> None:
    """Drop what the terminal holds unread: a line typed before the question (for a call that
    another device or the timeout decided meanwhile, or while the model was still talking)
    must not answer it."""
    with contextlib.suppress(OSError, ValueError, termios.error):
        termios.tcflush(stream.fileno(), termios.TCIFLUSH)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


async def _read_line(stream: TextIO) -> str:
    """One line from a terminal without blocking the loop; cancellable (another device may
    decide while we wait)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[str] = loop.create_future()
    fd = stream.fileno()

    def readable() -> None:
        if not done.done():
            done.set_result(stream.readline())

    loop.add_reader(fd, readable)
    try:
        return await done
    finally:
        loop.remove_reader(fd)


class _Interrupts:
    """First Ctrl-C: stop the run through the API. Second: give up waiting."""

    def __init__(self) -> None:
        self.count = 0
        self.first = asyncio.Event()
        self.second = asyncio.Event()

    def __call__(self) -> None:
        self.count += 1
        (self.first if self.count == 1 else self.second).set()


async def ask(client: AgentClient, text: str, *, conversation: str | None = None,
              model: str | None = None, params: Mapping[str, Any] | None = None,
              out: TextIO | None = None, err: TextIO | None = None,
              show_tools: bool | None = None, handle_sigint: bool = True,
              raw: bool = False, approver: Approver | None = None) -> AskOutcome:
    """Ask and stream the answer to `out`; `raw` keeps control characters on a terminal."""
    out = out or sys.stdout
    err = err or sys.stderr
    approver = approver or Approver()
    if show_tools is None:
        show_tools = err.isatty()
    screens = _Screens(out=not raw and out.isatty(), err=not raw and err.isatty())
    interrupts = _Interrupts()
    loop = asyncio.get_running_loop()
    installed = False
    if handle_sigint:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGINT, interrupts)
            installed = True
    try:
        # Ctrl-C while the turn is being posted (a slow or unreachable daemon retries for up
        # to a minute) ends `ask` there: it used to wait for the post, then stop the turn.
        posting = asyncio.create_task(_post_turn(client, conversation, text, model, params,
                                                 err))
        if not await _unless_interrupted(posting, interrupts.first):
            return AskOutcome(RunStatus.CANCELLED, None, None, None, True, note=(
                "stopped before the daemon answered the post; if the turn had reached it, "
                "it runs, and agenttui shows it"))
        conversation_id, run = posting.result()
        follow = asyncio.create_task(_follow(client, run.run_id, out, err, show_tools,
                                             screens, approver))
        stopper = asyncio.create_task(_stop_on_interrupt(client, run.run_id, interrupts, err))
        giving_up = asyncio.create_task(interrupts.second.wait())
        try:
            await asyncio.wait([follow, giving_up], return_when=asyncio.FIRST_COMPLETED)
        finally:
            giving_up.cancel()
            if not follow.done():
                follow.cancel()
        if not follow.done() or follow.cancelled():
            # Gave up waiting: the stop asked for at the first Ctrl-C gets a moment to be
            # answered, and the line says whether it was (the run may otherwise go on).
            asked = await _stop_answered(stopper)
            return AskOutcome(RunStatus.CANCELLED, run.run_id, conversation_id,
                              "stopped waiting", True, note=(
                                  "stopped waiting; the run was asked to stop, and what it "
                                  "wrote is kept in the conversation" if asked else
                                  "stopped waiting; the run could not be asked to stop and "
                                  "may still be running (stop it from agenttui)"))
        stopper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopper
        status, error, wrote = follow.result()
        if wrote and out.isatty():
            out.write("\n")
            out.flush()
        return AskOutcome(status, run.run_id, conversation_id, error, interrupts.count > 0)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


async def _post_turn(client: AgentClient, conversation: str | None, text: str,
                     model: str | None, params: Mapping[str, Any] | None,
                     err: TextIO) -> tuple[str, CreatedRun]:
    conversation_id, created = await resolve_conversation(client, conversation, text, model)
    if created and err.isatty():
        print(f"agenttui: conversation {conversation_id}", file=err)
    return conversation_id, await client.create_run(conversation_id, text, model=model,
                                                     params=params)


async def _unless_interrupted(task: asyncio.Task[Any], interrupted: asyncio.Event) -> bool:
    """Whether `task` finished (its result or error is then there) before `interrupted`; if
    not, it is cancelled."""
    stop = asyncio.create_task(interrupted.wait())
    try:
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if task.done():
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, ApiError):
        await task
    return False


# How long giving up waiting still waits for the answer to the stop already asked for.
STOP_ANSWER_WAIT_S = 5.0


async def _stop_answered(stopper: asyncio.Task[bool]) -> bool:
    """Whether the stop asked for was answered (within STOP_ANSWER_WAIT_S)."""
    done, _ = await asyncio.wait([stopper], timeout=STOP_ANSWER_WAIT_S)
    if not done:
        stopper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopper
        return False
    return not stopper.cancelled() and stopper.result()


async def _stop_on_interrupt(client: AgentClient, run_id: str, interrupts: _Interrupts,
                             err: TextIO) -> bool:
    """At the first Ctrl-C, ask the daemon to stop the run; whether it answered."""
    await interrupts.first.wait()
    print("\nagenttui: stopping the run (Ctrl-C again to stop waiting)…", file=err)
    try:
        await client.cancel_run(run_id)
    except ApiError as exc:
        print(f"agenttui: could not stop the run: {describe(exc)}", file=err)
        return False
    return True


async def _answer(client: AgentClient, run_id: str, payload: dict[str, Any],
                  approver: Approver, err: TextIO) -> None:
    call_id = str(payload.get("call_id"))
    decision, note = await approver.decide(payload, err)
    try:
        await client.decide_approval(run_id, call_id, decision, note)
    except Conflict as exc:  # names the device that decided first: its name is not ours
        print(without_controls(f"agenttui: {payload.get('tool')}: {exc.message}"), file=err)
    except ApiError as exc:
        print(f"agenttui: the decision was not recorded: {describe(exc)}", file=err)


async def _follow(client: AgentClient, run_id: str, out: TextIO, err: TextIO,
                  show_tools: bool, screens: _Screens, approver: Approver,
                  ) -> tuple[RunStatus | str | None, str | None, bool]:
    asking: dict[str, asyncio.Task[None]] = {}
    try:
        return await _follow_events(client, run_id, out, err, show_tools, screens, approver,
                                    asking)
    finally:
        for task in asking.values():
            task.cancel()


async def _follow_events(client: AgentClient, run_id: str, out: TextIO, err: TextIO,
                         show_tools: bool, screens: _Screens, approver: Approver,
                         asking: dict[str, asyncio.Task[None]],
                         ) -> tuple[RunStatus | str | None, str | None, bool]:
    wrote = False
    outage = False
    async for item in client.run_events(run_id):
        if isinstance(item, ConnectionStatus):
            if item.state == ConnectionState.RECONNECTING and not outage:
                outage = True
                print(f"agenttui: connection lost ({item.error}); reconnecting…", file=err)
            elif item.connected and outage:
                outage = False
                print("agenttui: reconnected; resuming the stream", file=err)
            continue
        if not isinstance(item, RunEvent):
            continue
        if item.type == EventType.CONTENT_DELTA:
            out.write(without_controls(item.delta) if screens.out else item.delta)
            out.flush()
            wrote = wrote or bool(item.delta)
        elif item.type == EventType.TOOL_CALL and show_tools:
            line = f"· {item.payload.get('name')} {item.payload.get('arguments') or {}}"
            print(without_controls(line) if screens.err else line, file=err)
        elif item.type == EventType.APPROVAL_REQUESTED:
            call_id = str(item.payload.get("call_id"))
            if call_id not in asking:
                asking[call_id] = asyncio.create_task(
                    _answer(client, run_id, item.payload, approver, err))
        elif item.type == EventType.APPROVAL_DECIDED:
            call_id = str(item.payload.get("call_id"))
            prompt = asking.get(call_id)
            if prompt is not None and not prompt.done():
                prompt.cancel()  # decided elsewhere while we were asking
                err.write("\n")
            # Another device's name and note, and a tool server's tool name: printable only.
            print(without_controls(f"agenttui: {item.payload.get('tool')} "
                                   f"{_decided(item.payload)}"), file=err, flush=True)
        elif item.type == EventType.COMPLETE:
            status = item.payload.get("status")
            try:
                status = RunStatus(str(status))
            except ValueError:
                pass
            error, code = item.payload.get("error"), item.payload.get("error_code")
            # The daemon's short message and its stable code (the detail is in its log).
            return status, f"{error} ({code})" if error and code else error, wrote
    return None, "the stream ended without an outcome", wrote


def _decided(payload: dict[str, Any]) -> str:
    if payload.get("timed_out"):
        return "denied: nobody decided in time"
    verb = "approved" if payload.get("decision") == "approve" else "denied"
    note = f": {payload['note']}" if payload.get("note") else ""
    return f"{verb} by {payload.get('device') or 'a device'}{note}"


def report(outcome: AskOutcome, err: TextIO) -> None:
    """One line on stderr for anything but success."""
    if outcome.status == RunStatus.COMPLETED:
        return
    if outcome.note is not None:
        print(f"agenttui: {outcome.note}", file=err)
    elif outcome.status == RunStatus.CANCELLED:
        print(f"agenttui: the run was cancelled ({outcome.error or 'stopped'}); "
              f"any partial answer is kept in the conversation", file=err)
    else:
        print(f"agenttui: the run {outcome.status or 'did not finish'}: "
              f"{outcome.error or 'no reason given'}", file=err)
