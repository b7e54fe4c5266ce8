"""The transcript: one view per turn — question, compact tool lines, the answer as Markdown.

Only a window of turns is mounted (see Transcript): a conversation of thousands of messages
costs what its visible part costs. Views redraw from the ConversationModel only where it
changed. A running answer is appended through Markdown.get_stream() (which re-parses only the
last block); once it stops, its whole text is rendered again into one cheap widget
(SettledMarkdown), which also repairs what a stream can lose inside a partial code fence.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

from rich.markdown import Markdown as RichMarkdown
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from agentd.vocabulary import MessageStatus, RunStatus
from agenttui.conversation import Changes, ConversationModel, ToolStep, Turn
from agenttui.widgets.marks import SUPERSEDED_NOTE, answer_usage


class SettledMarkdown(Static):
    """A finished answer, rendered once through Rich's Markdown into ONE widget.

    Textual's Markdown widget mounts a widget per block (each list item, each paragraph): about
    five times the cost of this when older turns are mounted while scrolling. It stays the
    widget for the answer that is streaming (Markdown.get_stream()); an answer that stopped is
    rendered here from its whole text, which also repairs what a stream can lose inside a
    partial code fence."""

    DEFAULT_CSS = """
    SettledMarkdown { height: auto; padding: 0; background: transparent; }
    """

    def __init__(self) -> None:
        super().__init__("", markup=False)
        self.source = ""

    def show(self, text: str) -> None:
        if text != self.source:
            self.source = text
            self.update(RichMarkdown(text) if text else "")


FREEZE_AT = 1000  # a streaming tail longer than this (characters) freezes its head
KEEP_LIVE = 200  # what stays live after a freeze: the last block may still change
FENCE = re.compile(r"^(```|~~~)", re.MULTILINE)


def freeze_point(tail: str) -> int:
    """Where to cut a long streaming tail: after the last paragraph break that is not inside a
    code fence and leaves KEEP_LIVE characters live; else at the last space outside a fence
    (one long paragraph); 0: nowhere safe (inside a long code block)."""
    limit = len(tail) - KEEP_LIVE
    at = tail.rfind("\n\n", 0, limit)
    while at > 0:
        if len(FENCE.findall(tail, 0, at)) % 2 == 0:
            return at + 2
        at = tail.rfind("\n\n", 0, at)
    space = tail.rfind(" ", 0, limit)
    if space > 0 and len(FENCE.findall(tail, 0, space)) % 2 == 0:
        return space + 1
    return 0


class AnswerView(Vertical):
    """The assistant's answer and one line saying how it ended (or that it is still going).

    A streaming answer re-renders only its tail: the live Markdown widget holds at most about
    FREEZE_AT characters; its head is frozen into Rich-rendered chunks, each drawn once, so a
    delta costs the same at the 20,000th character as at the first. When the answer stops, the
    whole text is drawn once into the settled widget."""

    DEFAULT_CSS = """
    AnswerView { height: auto; padding: 0 0 0 1; }
    AnswerView > Markdown { margin: 0; padding: 0; background: transparent; }
    AnswerView > .frozen { height: auto; }
    AnswerView > .frozen > Static { height: auto; }
    AnswerView > .answer-status { color: $text-muted; height: auto; }
    AnswerView > .answer-status.-stopped { color: $warning; }
    AnswerView > .answer-status.-failed { color: $error; }
    AnswerView > .answer-status.-live { color: $accent; }
    """

    def __init__(self) -> None:
        super().__init__(classes="answer")
        # Created when the answer first streams: most turns never need them.
        self.frozen: Vertical | None = None
        self.live: Markdown | None = None
        self.settled = SettledMarkdown()
        self.status_line = Static("", classes="answer-status", markup=False)
        self._stream: MarkdownStream | None = None
        self._shown = ""  # text already handed to the widgets (streamed or settled)
        self._frozen = 0  # characters of _shown drawn in frozen chunks (the rest is live)
        self._live = False  # the live widgets hold the text (streaming, or it just stopped)
        self.status_text = ""

    def compose(self) -> ComposeResult:
        yield self.settled
        yield self.status_line

    @property
    def md(self) -> Markdown | SettledMarkdown:
        """The widget that shows the answer's text now (both have `source`)."""
        return self.live if self._live and self.live is not None else self.settled

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
        if self.live is not None:
            self.live.display = self._live and bool(turn.text)
        self.settled.display = not self._live and bool(turn.text)
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
            if text == self._shown and self._live:
                return
            live = await self._live_widget()
            if self._live and text.startswith(self._shown):
                if self._stream is None:
                    self._stream = Markdown.get_stream(live)
                await self._stream.write(text[len(self._shown):])  # only the tail re-parses
            else:
                await self._stop_stream()
                await self._unfreeze()
                await live.update(text)
                self._live = True
            self._shown = text
            await self._freeze_head()
            return
        await self._stop_stream()
        if self._live:
            self._live = False
            await self._unfreeze()
            if self.live is not None:
                await self.live.update("")  # its blocks go; the settled view shows it all
        self.settled.show(text)
        self._shown = text

    async def _live_widget(self) -> Markdown:
        if self.live is None:
            self.frozen = Vertical(classes="frozen")
            self.live = Markdown("")
            await self.mount_all([self.frozen, self.live], before=self.settled)
        return self.live

    async def _freeze_head(self) -> None:
        """Move the head of a long live tail into a frozen chunk (drawn once, never again)."""
        tail = self._shown[self._frozen:]
        if len(tail) <= FREEZE_AT or self.frozen is None or self.live is None:
            return
        cut = freeze_point(tail)
        if cut <= 0:
            return
        await self._stop_stream()
        await self.frozen.mount(Static(RichMarkdown(tail[:cut])))
        self._frozen += cut
        await self.live.update(tail[cut:])

    async def _unfreeze(self) -> None:
        self._frozen = 0
        if self.frozen is not None and self.frozen.children:
            await self.frozen.remove_children()

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
        self.tools: Vertical | None = None  # created with the first tool call: most turns have none
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
            if self.tools is None:
                self.tools = Vertical(classes="tools")
                await self.mount(self.tools, before=self.answer)
            await self.tools.mount_all(new_lines)
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


# The most turns mounted at once: widget count stays bounded however long the conversation.
# Textual arranges every mounted widget of a scrolled container again on each scroll, so a
# PageUp costs in proportion to this (40 turns: PageUp p50 76 ms, p99 109 ms; 24: 39 and 91
# ms; docs/benchmarks.md, TUI). Fewer only while they still cover the screen and its margins:
# short turns on a tall terminal keep more (see `_trim`).
WINDOW_TURNS = 24
PAGE_TURNS = 4  # turns mounted per step when the reader scrolls past what is mounted
PAGE_TURNS_MARGIN = 1  # screens of mounted text kept above (below) the view before mounting more


class Transcript(VerticalScroll):
    """The open conversation, newest at the bottom (kept in view while at it), virtualized:
    only a window of turns is mounted (what fits the screen plus a margin at first, at most
    WINDOW_TURNS), older ones mount as the reader scrolls up and far-off ones are unmounted,
    so opening and streaming cost the same however long the conversation is. Turns the model
    does not hold yet are fetched through `fetch_older` (the next older page of the API).

    `sync` runs under `lock` held by its caller; the paging methods take it themselves.
    """

    DEFAULT_CSS = """
    Transcript { height: 1fr; padding: 0 0 0 1; }
    Transcript > .empty { color: $text-muted; padding: 1 2; }
    Transcript > .more { color: $text-muted; text-style: italic; height: 1; }
    Transcript.-veiled > * { visibility: hidden; }
    """

    def __init__(self, *, lock: asyncio.Lock | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Not `lock`: Widget.lock is Textual's own re-entrant lock for mounting and removing.
        self.render_lock = lock or asyncio.Lock()
        self.views: dict[str, TurnView] = {}  # the mounted turns, top to bottom
        self.keys: list[str] = []  # the model's turn order as last synced
        self.start = 0  # keys[start:end] are mounted
        self.end = 0
        self.model: ConversationModel | None = None
        self.fetch_older: Callable[[], Awaitable[None]] | None = None
        self.remounted: Callable[[], None] | None = None  # views came back: re-mark selection
        self.paging = False  # mounting (or fetching) older or newer turns right now
        self.older = Static("", classes="more older", markup=False)
        self.newer = Static("", classes="more newer", markup=False)
        self.empty = Static("", classes="empty", markup=False)
        self._empty_message = ""

    def compose(self) -> ComposeResult:
        yield self.older
        yield self.newer
        yield self.empty

    def on_mount(self) -> None:
        self.anchor()
        self._show_edges()

    async def reset(self, message: str = "") -> None:
        self.remove_class("-veiled")  # a fill under way for the turns going now ends here
        await self._unmount_all()
        self.keys, self.model = [], None
        self.set_empty(message)
        self._show_edges()

    async def _unmount_all(self) -> None:
        views, self.views = list(self.views.values()), {}
        self.start = self.end = 0
        if views:
            await self.remove_children(views)

    def set_empty(self, message: str) -> None:
        self._empty_message = message
        self.empty.update(message)
        self.empty.display = bool(message) and not self.views

    @property
    def following(self) -> bool:
        """The newest turn is mounted: new turns mount below it as they arrive."""
        return self.end >= len(self.keys)

    async def sync(self, model: ConversationModel, changes: Changes) -> None:
        self.model = model
        if changes.rebuild:
            await self._rewindow(model.order)
        touched = set(changes.turns)
        if model.queued_turns:
            touched |= {t.key for t in model.queued_turns}  # queue positions move together
        for key in touched:
            view = self.views.get(key)
            if view is not None:
                await view.show(model.turns[key], model)
        self.empty.display = bool(self._empty_message) and not self.views
        self._show_edges()

    async def _rewindow(self, keys: list[str]) -> None:
        """Place the mounted turns in the model's new order; mount new turns at the bottom
        when the newest was in view; start over from the newest if the order changed."""
        mounted = list(self.views)
        following = self.following
        at = _index(keys, mounted[0]) if mounted else None
        if at is None or keys[at: at + len(mounted)] != mounted:
            # First sync, or removed/reordered (a fresh snapshot disagreed): the newest turns.
            self.keys = list(keys)
            await self._mount_newest()
            return
        self.keys = list(keys)
        self.start, self.end = at, at + len(mounted)
        if following and self.end < len(keys):
            await self._mount(self.end, len(keys))
            await self._trim(top=True)

    async def _mount(self, lo: int, hi: int) -> None:
        """Mount keys[lo:hi] next to the mounted ones (above them when lo < start)."""
        if lo >= hi or self.model is None:
            return
        keys = self.keys[lo:hi]
        views = [TurnView(key) for key in keys]
        was_empty = not self.views
        if not was_empty and lo < self.start:
            first = next(iter(self.views.values()))
            await self.mount_all(views, before=first)
            self.views = {**dict(zip(keys, views, strict=True)), **self.views}
            self.start = lo
        else:
            await self.mount_all(views, before=self.newer)
            self.views.update(zip(keys, views, strict=True))
            if was_empty:
                self.start = lo
            self.end = hi
        for key, view in zip(keys, views, strict=True):
            await view.show(self.model.turns[key], self.model)

    async def _trim(self, *, top: bool) -> None:
        """Unmount the turns farthest from the reader beyond WINDOW_TURNS (top or bottom),
        but never so many that what stays mounted is shorter than the screen and a margin on
        either side: otherwise short turns on a tall terminal would leave the window unable to
        fill the screen, and filling it would walk page by page to the conversation's start."""
        extra = len(self.views) - WINDOW_TURNS
        if extra <= 0:
            return
        keys = list(self.views)
        farthest = keys[:extra] if top else keys[::-1][:extra]
        height = self.virtual_size.height  # turns mounted just now are not laid out: not in it
        keep = (2 * PAGE_TURNS_MARGIN + 1) * self.size.height
        gone = []
        for key in farthest:
            height -= self.views[key].outer_size.height
            if height < keep:
                break
            gone.append(key)
        if not gone:
            return
        extra = len(gone)
        views = [self.views.pop(key) for key in gone]
        if top:
            self.start += extra
        else:
            self.end -= extra
        await self.remove_children(views)

    async def _mount_newest(self) -> None:
        """Start over from the newest page of `keys`, then fill the screen above it."""
        await self._unmount_all()
        self.start = self.end = len(self.keys)
        newest = self.keys[-PAGE_TURNS:]
        self._veil(newest)
        await self._mount(len(self.keys) - len(newest), len(self.keys))
        self.call_after_refresh(self._fill)

    def _veil(self, keys: list[str]) -> None:
        """Hide the turns `keys`, about to be mounted, until _fill has covered the screen, when
        they may not cover it themselves. While the newest turns are shorter than the screen,
        Textual (8.2) keeps an anchored view at the bottom with a negative scroll offset, and
        as pages mount above, frames can be drawn with a stale one: the newest turns pushed out
        of view, a blank band above (https://github.com/Textualize/textual/issues/6652). Filling
        takes a few pages on a tall terminal with short turns; the reader sees a full screen
        at once instead of those frames (turns that cover the screen have offsets of 0 or more,
        so the margin above it fills in sight). Hidden by visibility, so the turns are still
        laid out and measured. Turns sure to cover the screen are not hidden: showing them a
        refresh later cost a conversation's opening about 90 ms (bench/tui.py)."""
        height = self.size.height  # 0: not laid out yet, so unknown
        if self.model is None or not height or _rows_at_least(
                [self.model.turns[key] for key in keys], self.size.width) < height:
            self.add_class("-veiled")

    def _fill(self) -> None:
        """Mount older turns until the screen (plus a margin) is full; show them once they
        cover the screen (the margin above fills in sight: no frame then leaves the newest)."""
        height = self.virtual_size.height  # the screen's own while shorter than it
        more = self.start > 0 and height < 2 * self.size.height
        if height > self.size.height or not more:
            self.remove_class("-veiled")
        if more:
            self.run_worker(self._fill_more(), group="transcript-page", exit_on_error=False)

    async def _fill_more(self) -> None:
        mounted = False
        try:
            mounted = await self.page_older()
        finally:
            if mounted or (self.paging and self.start > 0):  # or another page is mounting
                self.call_after_refresh(self._fill)  # laid out by then: filled enough?
            else:
                # Nothing more to mount, or mounting failed: show what is mounted.
                self.remove_class("-veiled")

    async def page_older(self) -> bool:
        """Mount the turns above the mounted ones (fetching a page first if the model has
        none), keeping what the reader sees in place; whether any were mounted."""
        if self.paging:
            return False
        self.paging = True
        try:
            model = self.model
            if self.start == 0 and model is not None and model.has_more and self.fetch_older:
                await self.fetch_older()
            async with self.render_lock:
                if self.start == 0 or not self.views:
                    return False
                first = next(iter(self.views.values()))
                before = first.virtual_region.y
                await self._mount(max(0, self.start - PAGE_TURNS), self.start)
                await self._trim(top=False)
                self._show_edges()
            self._keep_in_place(first, before)
            if self.remounted is not None:
                self.remounted()
            return True
        finally:
            self.paging = False

    async def page_newer(self) -> None:
        """Mount the turns below the mounted ones (unmounting far-off ones above)."""
        if self.paging:
            return
        self.paging = True
        try:
            async with self.render_lock:
                if self.following or not self.views:
                    return
                last = list(self.views.values())[-1]
                before = last.virtual_region.y
                await self._mount(self.end, min(len(self.keys), self.end + PAGE_TURNS))
                await self._trim(top=True)
                self._show_edges()
            self._keep_in_place(last, before)
            if self.remounted is not None:
                self.remounted()
        finally:
            self.paging = False

    def _keep_in_place(self, view: Widget, before: int) -> None:
        def restore() -> None:
            shift = view.virtual_region.y - before
            # At the bottom, the view is where it was: the anchor kept turns mounted above a
            # reader who follows the newest out of view (the screen's margin filling on open).
            # Scrolling then would release the anchor (Textual 8.2's scroll_to always does),
            # and with the view already at the bottom nothing takes it back: the next turn
            # would mount out of sight.
            if shift and self.scroll_y < self.max_scroll_y:
                self.scroll_to(y=self.scroll_y + shift, animate=False, immediate=True)

        self.call_after_refresh(restore)

    async def show_newest(self) -> None:
        """Back to the newest turns (after a jump or a long scroll up); runs under `lock`."""
        if not self.following:
            await self._mount_newest()
            self._show_edges()
        self.anchor()

    async def reveal(self, key: str) -> TurnView | None:
        """Mount the turn `key` (with its neighbours) and scroll to it; runs under `lock`."""
        view = self.views.get(key)
        if view is None:
            at = _index(self.keys, key)
            if at is None:
                return None
            await self._unmount_all()
            lo = max(0, at - PAGE_TURNS // 2)
            self.start = self.end = lo
            await self._mount(lo, min(len(self.keys), lo + PAGE_TURNS))
            self._show_edges()
            view = self.views[key]
        self.release_anchor()
        self.call_after_refresh(self.scroll_to_widget, view, animate=False, top=True)
        return view

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if self.paging or not self.views:
            return
        margin = PAGE_TURNS_MARGIN * self.size.height  # mount before the reader reaches the edge
        # After the next refresh: the page the reader scrolled to is drawn first.
        if new_value <= margin and (self.start > 0 or (self.model and self.model.has_more)):
            self.call_after_refresh(self._start_paging, self.page_older)
        elif new_value >= self.max_scroll_y - margin and not self.following:
            self.call_after_refresh(self._start_paging, self.page_newer)

    def _start_paging(self, page: Callable[[], Awaitable[None]]) -> None:
        if not self.paging:
            self.run_worker(page(), group="transcript-page", exit_on_error=False)

    def _show_edges(self) -> None:
        above = self.start
        more = self.model is not None and self.model.has_more
        if above or more:
            count = f"{above} earlier turn{'s' if above != 1 else ''}" if above else \
                "earlier messages"
            self.older.update(f"↑ {count}{' and more on the server' if above and more else ''}"
                              f" · PageUp or scroll up to read")
        self.older.display = bool(self.views) and bool(above or more)
        below = len(self.keys) - self.end
        self.newer.update(f"↓ {below} newer turn{'s' if below != 1 else ''} · Ctrl+End "
                          f"jumps to the newest")
        self.newer.display = bool(self.views) and below > 0


def _rows_at_least(turns: list[Turn], width: int) -> int:
    """About the fewest rows these turns can take at `width` columns: their text's lines,
    wrapped, and each turn's own head, foot and gap. Markdown drawn from it may take fewer
    (a code fence's marks), never many fewer."""
    columns = max(1, width - 6)  # the transcript's border and padding, the text's indent
    rows = 0
    for turn in turns:
        rows += 3
        for line in (turn.question + "\n" + turn.text).splitlines():
            rows += max(1, -(-len(line) // columns))
    return rows


def _index(keys: list[str], key: str) -> int | None:
    try:
        return keys.index(key)
    except ValueError:
        return None
