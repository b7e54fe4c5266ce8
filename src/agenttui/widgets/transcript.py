"""The transcript: one view per turn — question, compact tool lines, the answer as Markdown.

Views redraw from the ConversationModel only where it changed. A running answer is appended
through Markdown.get_stream(); once it stops, one final update() renders the whole text again
(a stream can lose text inside a partial code fence). `layout: stream` keeps long chats fast.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from agentd.vocabulary import MessageStatus, RunStatus
from agenttui.conversation import Changes, ConversationModel, ToolStep, Turn
from agenttui.widgets.marks import SUPERSEDED_NOTE, answer_usage


class AnswerView(Vertical):
    """The assistant's answer and one line saying how it ended (or that it is still going)."""

    DEFAULT_CSS = """
    AnswerView { height: auto; padding: 0 0 0 1; }
    AnswerView > Markdown { margin: 0; padding: 0; background: transparent; }
    AnswerView > .answer-status { color: $text-muted; height: auto; }
    AnswerView > .answer-status.-stopped { color: $warning; }
    AnswerView > .answer-status.-failed { color: $error; }
    AnswerView > .answer-status.-live { color: $accent; }
    """

    def __init__(self) -> None:
        super().__init__(classes="answer")
        self.md = Markdown("")
        self.status_line = Static("", classes="answer-status", markup=False)
        self._stream: MarkdownStream | None = None
        self._shown = ""  # text already handed to the widget (streamed or updated)
        self._settled = False  # the widget holds exactly _shown through update()
        self.status_text = ""

    def compose(self) -> ComposeResult:
        yield self.md
        yield self.status_line

    @property
    def shown_text(self) -> str:
        return self._shown

    @property
    def streaming(self) -> bool:
        """Appending through a MarkdownStream right now."""
        return self._stream is not None

    async def show(self, turn: Turn) -> None:
        self.display = bool(turn.text) or turn.started or (
            turn.finished and turn.question_status != MessageStatus.DRAFT)
        await self._render_text(turn.text, streaming=turn.running)
        self.md.display = bool(turn.text)
        status, kind = answer_status(turn)
        status = " · ".join(part for part in (status, answer_usage(turn)) if part)
        self.status_text = status
        self.status_line.update(status)
        self.status_line.display = bool(status)
        self.status_line.set_class(kind == "stopped", "-stopped")
        self.status_line.set_class(kind == "failed", "-failed")
        self.status_line.set_class(kind == "live", "-live")

    async def _render_text(self, text: str, *, streaming: bool) -> None:
        if streaming:
            if text == self._shown:
                return
            if text.startswith(self._shown) and (self._stream is not None or not self._shown
                                                 or self._settled):
                if self._stream is None:
                    self._stream = Markdown.get_stream(self.md)
                await self._stream.write(text[len(self._shown):])
            else:
                await self._stop_stream()
                await self.md.update(text)
            self._shown = text
            self._settled = False
            return
        if self._stream is not None:
            await self._stop_stream()
        elif self._settled and text == self._shown:
            return
        await self.md.update(text)  # the final, whole render
        self._shown = text
        self._settled = True

    async def _stop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.stop()

    async def on_unmount(self) -> None:
        await self._stop_stream()


def answer_status(turn: Turn) -> tuple[str, str]:
    """(the line under an answer, its kind: live / stopped / failed / "")."""
    status = turn.status
    if status == RunStatus.RUNNING:
        if turn.cancel_requested:
            return "⊘ stopping…", "stopped"
        return ("▍ streaming…" if turn.text else "▍ waiting for the first token…"), "live"
    if status == RunStatus.CANCELLED:
        if not turn.started:
            return "", ""
        if turn.text:
            return "⊘ cancelled — partial answer kept", "stopped"
        return "⊘ cancelled before any answer", "stopped"
    if status == RunStatus.FAILED:
        kept = " — partial answer kept" if turn.text else ""
        return f"✗ failed: {turn.error or 'no reason given'}{kept}", "failed"
    if status is None and turn.answer_status == MessageStatus.PARTIAL:
        return "⊘ partial answer (stopped early)", "stopped"
    return "", ""


class TurnView(Vertical):
    DEFAULT_CSS = """
    TurnView { height: auto; margin: 0 1 1 0; }
    TurnView > .turn-head { color: $text-muted; height: 1; }
    TurnView > .turn-head.-queued { color: $warning; }
    TurnView > .turn-head.-draft { color: $warning; text-style: italic; }
    TurnView > .question { background: $boost; padding: 0 1; height: auto; }
    TurnView > .question.-draft { color: $text-muted; text-style: strike; }
    TurnView > .tools { height: auto; padding: 0 0 0 1; }
    TurnView > .tools > .tool { color: $text-muted; height: 1; }
    TurnView > .tools > .tool.-error { color: $warning; }
    TurnView.-superseded { opacity: 55%; }
    """

    def __init__(self, key: str) -> None:
        super().__init__(classes="turn")
        self.key = key
        self.head = Static("", classes="turn-head", markup=False)
        self.question = Static("", classes="question", markup=False)
        self.tools = Vertical(classes="tools")
        self.answer = AnswerView()
        self._tool_lines: dict[str, Static] = {}
        self._question_text: str | None = None
        self.head_text = ""
        self._tool_texts: dict[str, str] = {}

    @property
    def tool_texts(self) -> list[str]:
        return list(self._tool_texts.values())

    def compose(self) -> ComposeResult:
        yield self.head
        yield self.question
        yield self.tools
        yield self.answer

    async def show(self, turn: Turn, model: ConversationModel) -> None:
        head, kind = turn_head(turn, model)
        self.head_text = head
        self.head.update(head)
        self.head.set_class(kind == "queued", "-queued")
        self.head.set_class(kind == "draft", "-draft")
        self.set_class(turn.superseded, "-superseded")
        if turn.question != self._question_text:
            self._question_text = turn.question
            self.question.update(Text(turn.question))
        self.question.set_class(turn.question_status == MessageStatus.DRAFT, "-draft")
        new_lines = []
        for call_id, step in turn.tools.items():
            line = self._tool_lines.get(call_id)
            if line is None:
                line = Static("", classes="tool", markup=False)
                self._tool_lines[call_id] = line
                new_lines.append(line)
            self._tool_texts[call_id] = tool_line(step)
            line.update(self._tool_texts[call_id])
            line.set_class(bool(step.error), "-error")
        if new_lines:
            await self.tools.mount_all(new_lines)
        self.tools.display = bool(self._tool_lines)
        await self.answer.show(turn)


def turn_head(turn: Turn, model: ConversationModel) -> tuple[str, str]:
    """The line above a question: who asked, and its place in the queue or fate as a draft."""
    mine = model.mine(turn)
    who = "you" if mine else (model.device_name(turn.device_id) or "another device")
    if turn.run_id is None:
        who = "copied when forked"
    if mine and model.me.device:
        who = f"you · {model.me.device}"
    if turn.question_status == MessageStatus.DRAFT:
        where = "your composer" if mine else "its author"
        return f"{who} · draft — cancelled before it ran, handed back to {where}", "draft"
    position = model.queue_position(turn)
    if position is not None:
        return f"{who} · queued #{position}", "queued"
    if turn.superseded:
        return f"{who} · {SUPERSEDED_NOTE}", "superseded"
    return who, ""


def tool_line(step: ToolStep) -> str:
    return f"⚙ {step.summary()}"


class Transcript(VerticalScroll):
    """All turns of the open conversation, newest at the bottom (kept in view while at it)."""

    DEFAULT_CSS = """
    Transcript { layout: stream; height: 1fr; padding: 0 0 0 1; }
    Transcript > .empty { color: $text-muted; padding: 1 2; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.views: dict[str, TurnView] = {}
        self.empty = Static("", classes="empty", markup=False)
        self._empty_message = ""

    def compose(self) -> ComposeResult:
        yield self.empty

    def on_mount(self) -> None:
        self.anchor()

    async def reset(self, message: str = "") -> None:
        views, self.views = list(self.views.values()), {}
        if views:
            await self.remove_children(views)
        self.set_empty(message)

    def set_empty(self, message: str) -> None:
        self._empty_message = message
        self.empty.update(message)
        self.empty.display = bool(message) and not self.views

    async def sync(self, model: ConversationModel, changes: Changes) -> None:
        keys = model.order
        touched = set(changes.turns)
        if changes.rebuild:
            mounted = list(self.views)
            if mounted != keys[: len(mounted)]:
                # Removed or reordered (a fresh snapshot disagreed): rebuild in server order.
                await self.reset()
            new_keys = [key for key in keys if key not in self.views]
            new_views = [TurnView(key) for key in new_keys]
            self.views.update(zip(new_keys, new_views, strict=True))
            if new_views:
                await self.mount_all(new_views)
            touched |= set(new_keys)
        if model.queued_turns:
            touched |= {t.key for t in model.queued_turns}  # queue positions move together
        for key in keys:
            if key in touched and key in self.views:
                await self.views[key].show(model.turns[key], model)
        self.empty.display = bool(self._empty_message) and not self.views
