"""`agenttui ask`: queue one turn and stream its answer to stdout, for scripts.

stdout gets exactly the answer text (plus a final newline on a terminal); everything else goes
to stderr. Ctrl-C asks the server to stop the run — a disconnect alone would not stop it — and
waits for the run to end; a second Ctrl-C leaves at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from agentd.vocabulary import EventType, RunStatus
from agenttui.client import AgentClient, ApiError, ConnectionState, ConnectionStatus, describe
from agenttui.models import RunEvent

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CANCELLED = 3
EXIT_UNREACHABLE = 4
EXIT_INTERRUPTED = 130

TITLE_CHARS = 60


@dataclass
class AskOutcome:
    status: RunStatus | str | None
    run_id: str | None
    conversation_id: str | None
    error: str | None
    interrupted: bool

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
              show_tools: bool | None = None, handle_sigint: bool = True) -> AskOutcome:
    out = out or sys.stdout
    err = err or sys.stderr
    if show_tools is None:
        show_tools = err.isatty()
    interrupts = _Interrupts()
    loop = asyncio.get_running_loop()
    installed = False
    if handle_sigint:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGINT, interrupts)
            installed = True
    try:
        conversation_id, created = await resolve_conversation(client, conversation, text,
                                                              model)
        if created and err.isatty():
            print(f"agenttui: conversation {conversation_id}", file=err)
        run = await client.create_run(conversation_id, text, model=model, params=params)
        follow = asyncio.create_task(_follow(client, run.run_id, out, err, show_tools))
        stopper = asyncio.create_task(_stop_on_interrupt(client, run.run_id, interrupts, err))
        giving_up = asyncio.create_task(interrupts.second.wait())
        try:
            await asyncio.wait([follow, giving_up], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stopper, giving_up):
                task.cancel()
            if not follow.done():
                follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopper
        if not follow.done() or follow.cancelled():
            return AskOutcome(RunStatus.CANCELLED, run.run_id, conversation_id,
                              "stopped waiting", True)
        status, error, wrote = follow.result()
        if wrote and out.isatty():
            out.write("\n")
            out.flush()
        return AskOutcome(status, run.run_id, conversation_id, error, interrupts.count > 0)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


async def _stop_on_interrupt(client: AgentClient, run_id: str, interrupts: _Interrupts,
                             err: TextIO) -> None:
    await interrupts.first.wait()
    print("\nagenttui: stopping the run (Ctrl-C again to stop waiting)…", file=err)
    try:
        await client.cancel_run(run_id)
    except ApiError as exc:
        print(f"agenttui: could not stop the run: {describe(exc)}", file=err)


async def _follow(client: AgentClient, run_id: str, out: TextIO, err: TextIO,
                  show_tools: bool) -> tuple[RunStatus | str | None, str | None, bool]:
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
            out.write(item.delta)
            out.flush()
            wrote = wrote or bool(item.delta)
        elif item.type == EventType.TOOL_CALL and show_tools:
            print(f"· {item.payload.get('name')} {item.payload.get('arguments') or {}}",
                  file=err)
        elif item.type == EventType.COMPLETE:
            status = item.payload.get("status")
            try:
                status = RunStatus(status)
            except ValueError:
                pass
            return status, item.payload.get("error"), wrote
    return None, "the stream ended without an outcome", wrote


def report(outcome: AskOutcome, err: TextIO) -> None:
    """One line on stderr for anything but success."""
    if outcome.status == RunStatus.COMPLETED:
        return
    if outcome.status == RunStatus.CANCELLED:
        print(f"agenttui: the run was cancelled ({outcome.error or 'stopped'}); "
              f"any partial answer is kept in the conversation", file=err)
    else:
        print(f"agenttui: the run {outcome.status or 'did not finish'}: "
              f"{outcome.error or 'no reason given'}", file=err)
