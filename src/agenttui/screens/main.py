"""The chat screen: conversation list, transcript, tool approvals, ownership bar, composer.

One worker follows the open conversation's feed and feeds the ConversationModel; every redraw
goes through one lock so views never race each other. Actions talk to the API and let the feed
show the outcome: the screen never decides ownership or a run's fate by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, OptionList
from textual.worker import Worker

from agentd.files import replace_file
from agentd.vocabulary import EventType
from agenttui.client import (
    AgentClient,
    ApiError,
    CertificateMismatch,
    Conflict,
    ConnectionState,
    ConnectionStatus,
    NotFound,
    Snapshot,
    Unauthorized,
    describe,
    new_idempotency_key,
    outcome_unknown,
)
from agenttui.conversation import Changes, ConversationModel
from agenttui.locations import clipboard_file
from agenttui.models import Conversation, CreatedRun, Me, RunEvent, SearchHit
from agenttui.screens.lifecycle import LifecycleScreen
from agenttui.screens.prompt import TextPrompt
from agenttui.screens.search import SearchScreen
from agenttui.settings import export_directory
from agenttui.widgets.approval import ApprovalPanel
from agenttui.widgets.composer import SEPARATOR, Composer
from agenttui.widgets.conversation_list import MORE, ConversationList
from agenttui.widgets.ownership_bar import OwnershipBar
from agenttui.widgets.transcript import Transcript

if TYPE_CHECKING:
    from agenttui.app import AgentTUI

TITLE_CHARS = 60
SNAPSHOT_MESSAGES = 100  # the feed's snapshot: the newest messages only (older ones paged in)
PAGE_MESSAGES = 100  # an older page, fetched when the reader scrolls past what is loaded
LIST_REFRESH_S = 30.0
LIST_SIZE = 100  # conversations listed at first, and added by "… older conversations"
LIST_PAGE_MAX = 1000  # the most the daemon answers in one page of its list
# A message put back after a lost answer keeps its Idempotency-Key this long: sent again exactly
# as it was, at once, it is the same message; typed again much later, a new one.
RESEND_WINDOW_S = 600.0
CODE_FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.DOTALL | re.MULTILINE)


def last_code_block(text: str) -> str | None:
    blocks = CODE_FENCE.findall(text)
    return blocks[-1][1] if blocks else None


def title_from(text: str) -> str:
    title = " ".join(text.split())
    return title if len(title) <= TITLE_CHARS else title[: TITLE_CHARS - 1] + "…"


def export_name(title: str, conversation_id: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40] or "conversation"
    return f"{slug}-{conversation_id[:8]}.md"


@dataclass(frozen=True)
class UncertainSend:
    """A send whose answer was lost: it may or may not have been posted."""

    text: str
    key: str  # its Idempotency-Key
    at: float  # time.monotonic() when its answer was lost
    # The turns its conversation showed before it was posted: a turn of this device with its
    # words that is not one of them is the send itself, landed.
    known: frozenset[str] = frozenset()


def landed(send: UncertainSend, turns: Mapping[str, Any], device_id: str) -> bool:
    """Whether the feed shows `send` posted: a new turn of this device asking its words."""
    words = send.text.strip()
    return any(key not in send.known and turn.device_id == device_id and
               turn.question.strip() == words for key, turn in turns.items())


def resent(text: str, uncertain: list[UncertainSend],
           handed_back: Sequence[str] = ()) -> list[UncertainSend | str]:
    """`text` as the messages it is, in order: an uncertain send (sent again under its own key,
    so the daemon replays it if it was posted) or a new message's text.

    `handed_back`: the texts the composer put back, unedited, at the head of `text` (a lost or
    refused send, a draft a stop returned), what was typed below them the rest. Each of them
    that is an uncertain send word for word goes as that send; the others and what was typed,
    between them, as new messages: sent as one new message, a lost send that had reached the
    daemon would be posted a second time inside it. Nothing typed is ever cut apart, so a
    paragraph that merely reads like a lost send stays in its message.

    Without them (edited, or none), `text` is uncertain sends only if it is some of them joined
    as the composer joins them (SEPARATOR between them, in the order they came back), and
    otherwise one new message: a message may hold blank lines of its own."""
    wanted = text.strip()
    if not handed_back:
        for first in range(len(uncertain)):
            for last in range(first, len(uncertain)):
                run = uncertain[first:last + 1]
                if SEPARATOR.join(u.text for u in run).strip() == wanted:
                    return list(run)
        return [wanted]
    parts: list[UncertainSend | str] = []
    new: list[str] = []  # new text since the last uncertain send, in order
    left = list(uncertain)
    typed = text[len(SEPARATOR.join(handed_back)):]
    for piece in [*handed_back, typed]:
        found = next((u for u in left if u.text.strip() == piece.strip() != ""), None)
        if found is None:
            if piece.strip():
                new.append(piece.strip())
            continue
        if new:
            parts.append(SEPARATOR.join(new))
            new = []
        parts.append(found)
        left.remove(found)
    if new:
        parts.append(SEPARATOR.join(new))
    return parts


# A blank line, whatever whitespace it holds: where one paragraph ends and the next begins.
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def holds_block(text: str, block: str) -> bool:
    """Whether `block` is whole paragraphs of `text`, blank lines and spaces around them
    aside: a draft "ok" is not in a composer that holds "look" or "ok, and"."""
    have = [p.strip() for p in _PARAGRAPH_BREAK.split(text.strip())]
    want = [p.strip() for p in _PARAGRAPH_BREAK.split(block.strip())]
    return any(have[at:at + len(want)] == want for at in range(len(have) - len(want) + 1))


@dataclass
class NewConversation:
    """Where messages typed while no conversation is open go: the first of them to be sent
    creates the conversation, and the others typed with it follow it there."""

    conversation_id: str | None = None


class MainScreen(LifecycleScreen):
    DEFAULT_CSS = """
    MainScreen #body { height: 1fr; }
    MainScreen #chat { width: 1fr; height: 1fr; }
    MainScreen ConversationList.-hidden { display: none; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", id="stop",
                tooltip="Stop the running turn and cancel queued ones (server-side)"),
        Binding("ctrl+n", "new_conversation", "New", id="new_conversation",
                tooltip="Start an empty conversation"),
        Binding("f2", "rename_conversation", "Rename", id="rename_conversation",
                tooltip="Give the open conversation a title"),
        Binding("ctrl+f", "search", "Search", id="search",
                tooltip="Find words in every conversation"),
        # PageUp/PageDown reach the transcript through the composer (Composer.PageTurned).
        Binding("ctrl+end", "transcript_newest", "Newest", id="transcript_newest", show=False,
                priority=True,
                tooltip="Back to the newest messages"),
        # Not ctrl+y / ctrl+e / ctrl+k: the composer uses those (redo, line end, delete).
        Binding("ctrl+o", "copy_answer", "Copy answer", id="copy_answer",
                tooltip="To the clipboard (and the clipboard file)"),
        Binding("alt+o", "copy_code", "Copy code", id="copy_code", show=False,
                tooltip="The last fenced code block of an answer"),
        Binding("ctrl+s", "export", "Export", id="export", show=False,
                tooltip="Write the open conversation to a .md file"),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", id="toggle_sidebar", show=False,
                tooltip="Show or hide the sidebar"),
        Binding("ctrl+l", "focus_list", "Conversations", id="focus_list", show=False),
        Binding("ctrl+pageup", "switch(-1)", "Previous conversation",
                id="previous_conversation", show=False),
        Binding("ctrl+pagedown", "switch(1)", "Next conversation", id="next_conversation",
                show=False),
        # Shown only while a tool call waits for approval; priority: the composer keeps focus.
        # Never an alt+ key: a terminal sends Alt+A as Esc then "a", so Esc (Stop) and a letter
        # typed quickly, or arriving in one read over SSH, would approve a tool. Control keys are
        # one byte, and these two are not the composer's own editing keys.
        Binding("ctrl+t", "decide_tool(True)", "Approve tool", id="approve_tool",
                priority=True),
        Binding("ctrl+r", "decide_tool(False)", "Deny tool", id="deny_tool", priority=True),
    ]

    app: AgentTUI

    def __init__(self) -> None:
        super().__init__()
        self.me: Me | None = None
        self.model: ConversationModel | None = None
        self.notices: deque[str] = deque(maxlen=50)  # recent messages, newest last
        self._render_lock = asyncio.Lock()
        # Sends go out one at a time, in the order they were made (the lock wakes waiters in
        # order): messages typed in one burst are queued in the order they were typed.
        self._send_lock = asyncio.Lock()
        self._jump_to: str | None = None  # a message to show once its conversation is open
        self._new_conversation: NewConversation | None = None  # Enter with none open
        # Handed-back drafts put in the composer, not yet sent nor deleted: id -> text.
        self._drafts_shown: dict[str, str] = {}
        self._feed: Worker[None] | None = None  # the open conversation's feed
        self._followed: ConversationModel | None = None  # the model that feed applies to
        # conversation id -> its latest send whose answer was lost: the same text sent there
        # again within RESEND_WINDOW_S reuses its Idempotency-Key, so the daemon replays the run
        # it may already have instead of adding a second one.
        self._list_failure: str | None = None  # the last refresh's failure, once said
        self._list_size = LIST_SIZE  # how many of the newest conversations the list shows
        # Per conversation, the sends whose answers were lost (within RESEND_WINDOW_S).
        self._uncertain: dict[str, list[UncertainSend]] = {}

    def notify(self, message: str, *, title: str = "",
               markup: bool = False, **kwargs: Any) -> None:
        """A toast; literal by default: messages quote titles, errors and paths."""
        self.notices.append(message)
        super().notify(message, title=title, markup=markup, **kwargs)

    @property
    def client(self) -> AgentClient:
        return self.app.client

    # -- layout ------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="body"):
            yield ConversationList(id="conversations")
            with Vertical(id="chat"):
                yield Transcript(id="transcript", lock=self._render_lock)
                yield ApprovalPanel(id="approval")
                yield OwnershipBar(self.app.server_now, id="ownership")
                yield Composer(id="composer")
        yield Footer()

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def bar(self) -> OwnershipBar:
        return self.query_one(OwnershipBar)

    @property
    def approval_panel(self) -> ApprovalPanel:
        return self.query_one(ApprovalPanel)

    @property
    def composer(self) -> Composer:
        return self.query_one(Composer)

    @property
    def conversation_list(self) -> ConversationList:
        return self.query_one(ConversationList)

    def on_mount(self) -> None:
        self.transcript.fetch_older = self.fetch_older
        self.transcript.remounted = lambda: self.apply_selection(rebuilt=True)
        self.composer.focus()
        self.bar.show(None, f"◌ connecting to {self.client.url}…")
        self.set_interval(LIST_REFRESH_S, self._refresh_list_quietly)
        self.boot()

    # -- start -------------------------------------------------------------------------------

    @work(group="boot", exclusive=True, exit_on_error=False)
    async def boot(self) -> None:
        attempt = 0
        while self.me is None:
            try:
                self.me = await self.client.me()
            except Unauthorized as exc:
                self.bar.show(None, f"✗ {self.client.url} refused the token ({exc.message}). "
                                    f"Pair again: `agentd pair` prints the line to run.")
                return
            except CertificateMismatch as exc:
                self.bar.show(None, f"✗ {exc.message}")  # never retried: it will not change
                return
            except ApiError as exc:
                attempt += 1
                delay = self.client.backoff.delay(attempt)
                self.bar.show(None, f"⟳ cannot reach {self.client.url} ({describe(exc)}); "
                                    f"retrying (attempt {attempt})")
                await asyncio.sleep(delay)
        conversations = await self._refresh_list()
        with contextlib.suppress(ApiError):  # only for the bar's "model X (default)"
            self.bar.default_model = (await self.client.list_models()).default_model
        target = self.app.settings.conversation
        if target is None and conversations:
            target = conversations[0].id
        if target is not None:
            await self.open_conversation(target)
        else:
            self.bar.show(None, "○ no conversations yet — type a message to start one")
            await self.transcript.reset("Type a message below and press Enter to start.")

    async def _refresh_list(self) -> list[Conversation]:
        try:
            conversations, more = await self._list()
        except ApiError as exc:
            said = f"Could not list conversations: {describe(exc)}"
            if said != self._list_failure:  # said once, not at every refresh while it lasts
                self._list_failure = said
                self.notify(said, severity="warning")
            return []
        self._list_failure = None
        current = self.model.conversation_id if self.model else None
        self.conversation_list.set_conversations(conversations, current, more=more)
        return conversations

    async def _list(self) -> tuple[list[Conversation], bool]:
        """The newest `_list_size` conversations, and whether older ones remain."""
        found: list[Conversation] = []
        after: str | None = None
        while True:
            page, after = await self.client.conversation_page(
                min(LIST_PAGE_MAX, self._list_size - len(found)),
                archived=self.showing_archived, after=after)
            found += page
            if after is None or len(found) >= self._list_size:
                return found, after is not None

    def _refresh_list_quietly(self) -> None:
        if self.me is not None:
            self.run_worker(self._refresh_list(), group="list", exclusive=True,
                            exit_on_error=False)

    # -- following a conversation ------------------------------------------------------------

    async def open_conversation(self, conversation_id: str) -> None:
        if self.me is None:
            return
        if self.model is not None and self.model.conversation_id == conversation_id and \
                self._followed is self.model and \
                self._feed is not None and not self._feed.is_finished:
            # Already open and followed. A feed that gave up starts again below, and so does
            # an open cut short before its feed began (the running feed is another model's).
            return
        self.model = ConversationModel(self.me, conversation_id,
                                       is_consumed=self._draft_settled)
        self._new_conversation = None  # Enter now sends to this one
        self.conversation_list.mark_current(conversation_id)
        async with self._render_lock:
            await self.transcript.reset()
        self.bar.show(self.model)
        self._followed = self.model
        self._feed = self.follow(self.model)

    @work(group="follow", exclusive=True, exit_on_error=False)
    async def follow(self, model: ConversationModel) -> None:
        stream = self.client.conversation_events(model.conversation_id, page=SNAPSHOT_MESSAGES)
        try:
            async with contextlib.aclosing(stream.__aiter__()) as items:
                async for item in items:
                    if model is not self.model:
                        return
                    changes = model.apply(item)
                    await self.render_changes(model, changes)
                    if changes.deleted:
                        await self.conversation_gone(model)
                        return
                    if changes.conversation:  # renamed, archived or restored elsewhere
                        self._refresh_list_quietly()
                    if isinstance(item, Snapshot) or (isinstance(item, RunEvent) and
                                                      item.type == EventType.USER_MESSAGE):
                        self.resolve_runs(model)
                    if isinstance(item, Snapshot) and self._jump_to is not None:
                        target, self._jump_to = self._jump_to, None
                        self.jump_to(model, target)
        except NotFound:
            known = model.snapshots or any(c.id == model.conversation_id
                                           for c in self.conversation_list.conversations)
            if known:
                # Deleted while this device did not listen (a closed lid, a dropped link), or
                # since the list was read: leave it, as when the deletion is heard.
                await self.conversation_gone(model)
                return
            self.bar.show(None, f"✗ conversation {model.conversation_id} does not exist "
                                f"(or belongs to another account)")
        except ApiError as exc:
            model.apply(ConnectionStatus(ConnectionState.CLOSED, error=describe(exc)))
            self.bar.show(model)
        except Exception as exc:  # a bug must not leave a stale screen that looks live
            model.apply(ConnectionStatus(ConnectionState.CLOSED,
                                         error=f"internal error: {describe(exc)}"))
            self.bar.show(model)
            raise

    # -- paging through a long transcript ----------------------------------------------------

    async def fetch_older(self) -> None:
        """The page before the oldest loaded turn, from the API, into the model."""
        model = self.model
        if model is None or not model.has_more or model.before is None:
            return
        asked = model.before
        try:
            page = await self.client.list_messages(model.conversation_id, before=asked,
                                                   limit=PAGE_MESSAGES)
        except ApiError as exc:
            self.notify(f"Could not load earlier messages: {describe(exc)}", severity="warning")
            return
        if model is self.model:
            await self.render_changes(model, model.apply_page(page, asked))

    @on(Composer.PageTurned)
    def _page_turned(self, event: Composer.PageTurned) -> None:
        self.action_transcript_page(event.step)

    def action_transcript_page(self, step: int) -> None:
        transcript = self.transcript
        if step < 0:
            if transcript.scroll_y <= 0:  # already at the top: the scroll will not move
                self.run_worker(transcript.page_older(), group="transcript-page",
                                exit_on_error=False)
            transcript.scroll_page_up(animate=False)
        else:
            transcript.scroll_page_down(animate=False)

    def action_transcript_newest(self) -> None:
        self.run_worker(self._show_newest(), group="transcript-page", exit_on_error=False)

    async def _show_newest(self) -> None:
        async with self._render_lock:
            await self.transcript.show_newest()
        self.apply_selection(rebuilt=True)

    @work(group="jump", exclusive=True, exit_on_error=False)
    async def jump_to(self, model: ConversationModel, message_id: str) -> None:
        """Show message `message_id`: load the pages down to it if needed, mount the turns
        around it, scroll to it."""
        key = model.key_of_message(message_id)
        # Again from the new cursor if a fresh snapshot replaced it while a page was on its
        # way (apply_page drops that page); a few times at most.
        for _ in range(3):
            if key is not None or not model.has_more or model.before is None:
                break
            asked = model.before
            try:
                page = await self.client.list_messages(
                    model.conversation_id, before=asked, limit=PAGE_MESSAGES,
                    until=message_id)
            except ApiError as exc:
                self.notify(f"Could not load that message: {describe(exc)}", severity="warning")
                return
            if model is not self.model:
                return
            await self.render_changes(model, model.apply_page(page, asked))
            key = model.key_of_message(message_id)
        if key is None or model is not self.model:
            self.notify("That message is no longer in the conversation.")
            return
        await self.reveal(key)

    async def reveal(self, key: str) -> None:
        """Mount turn `key` (and its neighbours) and scroll to it."""
        async with self._render_lock:
            view = await self.transcript.reveal(key)
        if view is not None:
            self.apply_selection(rebuilt=True)

    @work(group="resolve", exit_on_error=False)
    async def resolve_runs(self, model: ConversationModel) -> None:
        """Read the run rows the feed does not describe (author of a turn, how it ended)."""
        for run_id in model.runs_to_resolve():
            try:
                run = await self.client.get_run(run_id)
            except ApiError:
                continue
            if model is not self.model:
                return
            await self.render_changes(model, model.note_run(run))

    async def render_changes(self, model: ConversationModel, changes: Changes) -> None:
        async with self._render_lock:
            if model is not self.model:
                return
            if changes.rebuild or changes.turns:
                await self.transcript.sync(model, changes)
                self.apply_selection(rebuilt=changes.rebuild)
            if changes.rebuild and not model.order:
                self.transcript.set_empty("No messages yet. Type below and press Enter.")
            if changes.bar or changes.rebuild or changes.turns:
                self.bar.show(model)
            if changes.approvals or changes.bar or changes.rebuild:
                self._show_approvals(model)
            if model.title != self.sub_title:
                self.sub_title = model.title or "Untitled conversation"
            if changes.drafts:
                self._restore_drafts(model)

    def _restore_drafts(self, model: ConversationModel) -> None:
        drafts = model.take_drafts()
        if not drafts:
            return
        for draft in drafts:  # in queue order: each lands after the one before
            self.composer.put_back(draft.content)
            self._drafts_shown[draft.message_id] = draft.content
        self.notify("A stop handed your queued message back: it is in the composer.",
                    title="Draft returned")

    def _draft_settled(self, message_id: str) -> bool:
        """A draft not to offer again: settled on this device, or in the composer already."""
        return message_id in self.app.drafts or message_id in self._drafts_shown

    def settle_drafts(self, ids: Iterable[str] | None = None) -> None:
        """Handed-back drafts are offered again until they were sent (`ids`: those in the
        composer when a message that has now been posted was submitted) or deleted (None: the
        user quits, and those not in the composer are settled): a crash, a closed terminal or a
        dropped SSH link loses none of them."""
        if ids is None:
            text = self.composer.text if self._drafts_shown else ""
            ids = [message_id for message_id, content in self._drafts_shown.items()
                   if not holds_block(text, content)]
        settled = [message_id for message_id in ids if message_id in self._drafts_shown]
        self.app.drafts.consume(settled)
        for message_id in settled:
            del self._drafts_shown[message_id]

    # -- sending -----------------------------------------------------------------------------

    @on(Composer.Submitted)
    def _submitted(self, event: Composer.Submitted) -> None:
        # The conversation is the one open now, at Enter: an earlier send may still be waiting
        # for the daemon when the user moves to another conversation.
        if self.model is not None:
            target: str | NewConversation = self.model.conversation_id
        else:
            if self._new_conversation is None:
                self._new_conversation = NewConversation()
            target = self._new_conversation
        # The drafts shown now went out with this text or were deleted before it: settled once
        # it is posted (a send that fails puts them back in the composer with it).
        self.send(event.text, target, event.handed_back,
                  list(self._drafts_shown))  # composer cleared, in key order

    @work(group="send", exit_on_error=False)
    async def send(self, text: str, target: str | NewConversation, handed_back: Sequence[str],
                   drafts: list[str]) -> None:
        async with self._send_lock:
            try:
                sent = await self._send(text, target, handed_back)
            except Exception as exc:
                # A fault of agenttui's own: the text typed is not lost with it (the composer
                # was cleared at Enter).
                self.log.error("a send failed unexpectedly", repr(exc))
                self.composer.put_back(text, unless_here=True)
                self.notify(f"Your message may not have been sent ({type(exc).__name__}); it "
                            "is back in the composer.", severity="error", title="Send failed")
                return
            if sent:
                self.settle_drafts(drafts)

    async def _send(self, text: str, target: str | NewConversation,
                    handed_back: Sequence[str] = ()) -> bool:
        """Post `text` (`handed_back`: the texts the composer put back at its head, unedited);
        True once posted, False when it was put back in the composer."""
        settings = self.app.settings
        if self.me is None:
            self.composer.put_back(text, unless_here=False)
            self.notify(f"Not connected to {self.client.url} yet; your message is still here.",
                        severity="warning")
            return False
        try:
            if isinstance(target, NewConversation) and target.conversation_id is None:
                # Its runs use the model chosen here (F9), else this device's `model` setting.
                created = await self.client.create_conversation(
                    title_from(text), model=self.next_model or settings.model)
                target.conversation_id = created.id
                if self.model is None:  # not if the user opened another one meanwhile
                    await self.open_conversation(created.id)
                await self._refresh_list()
        except ApiError as exc:
            self.composer.put_back(text, unless_here=False)
            self.notify(f"Not sent: {describe(exc)}", severity="error", title="Send failed")
            return False
        conversation_id = target if isinstance(target, str) else target.conversation_id
        assert conversation_id is not None
        now = time.monotonic()
        earlier = [u for u in self._uncertain.get(conversation_id, [])
                   if now - u.at < RESEND_WINDOW_S]
        parts = resent(text, self._resendable(conversation_id, earlier, handed_back),
                       handed_back)
        again = [part for part in parts if isinstance(part, UncertainSend)]
        if not again:
            # A new message (one queued behind an uncertain send, say): it leaves those sends'
            # keys for their own resends.
            return await self._post(conversation_id, text, new_idempotency_key(), earlier)
        # A lost send sent again as it was goes under its own key, so the daemon replays what
        # it has; two handed back together go again one by one, never as a third, joined
        # message, and text beside them (a refused send, a draft, what was typed) goes as a
        # new message of its own, in the composer's order.
        left = [u for u in earlier if u not in again]
        for number, part in enumerate(parts):
            sent = (part.text, part.key) if isinstance(part, UncertainSend) else \
                (part, new_idempotency_key())
            if not await self._post(conversation_id, *sent, left):
                for later in parts[number + 1:]:  # not tried: back in the composer
                    if isinstance(later, UncertainSend):  # still keyed
                        self.composer.put_back(later.text, unless_here=False)
                        left.append(later)
                    else:
                        self.composer.put_back(later, unless_here=False)
                self._uncertain[conversation_id] = left
                return False
        self._uncertain[conversation_id] = left
        return True

    async def _post(self, conversation_id: str, text: str, key: str,
                    uncertain: list[UncertainSend]) -> bool:
        """One message under `key`; False (back in the composer) if not known to be posted:
        a lost answer joins `uncertain`, the conversation's sends to be sent again unchanged."""
        settings = self.app.settings
        # The turns shown before the post went out: a new one asking its words is the post.
        model = self.model
        known = frozenset(model.turns) if model is not None and \
            model.conversation_id == conversation_id else frozenset()
        try:
            run = await self.client.create_run(conversation_id, text, params=settings.params,
                                               idempotency_key=key)
        except ApiError as exc:
            if exc.code == "idempotency_conflict":
                # This key was posted before (keys are never reused for another text): a send
                # whose answer was lost did land, under settings or a model changed since.
                self.notify("Your message had reached the daemon after all (with the settings "
                            "it was first sent with): it was not posted again.")
                return True
            self.composer.put_back(text, unless_here=False)
            if not outcome_unknown(exc):
                self.notify(f"Not sent: {describe(exc)}", severity="error", title="Send failed")
                return False
            uncertain.append(UncertainSend(text, key, time.monotonic(), known))
            self._uncertain[conversation_id] = uncertain
            here = self.model is not None and self.model.conversation_id == conversation_id
            self.notify(f"Your message{'' if here else ' to another conversation'} may not "
                        f"have been sent: {describe(exc)}. It is back in the composer. Sent "
                        f"again exactly as it is to the same conversation, within "
                        f"{RESEND_WINDOW_S / 60:.0f} minutes, it will not be posted twice.",
                        severity="error", title="Send uncertain")
            return False
        try:
            await self._posted(conversation_id, run)
        except Exception as exc:  # posted all the same: never put back, never sent again
            self.log.error("showing a posted message failed", repr(exc))
        return True

    async def _posted(self, conversation_id: str, run: CreatedRun) -> None:
        if run.replayed:
            self.notify("Your message had reached the daemon after all: it was not posted "
                        "again.")
        model = self.model
        if model is None or model.conversation_id != conversation_id:
            self.notify("Your message was sent to the conversation it was typed in.")
            return  # the user has moved on: that conversation's feed is not followed here
        model.note_created(run.run_id)
        if not self.transcript.following:  # read far up: the new turn shows at the bottom
            await self._show_newest()
        await self.render_changes(model, Changes(turns={run.run_id}, bar=True))

    def _resendable(self, conversation_id: str, earlier: list[UncertainSend],
                    handed_back: Sequence[str]) -> list[UncertainSend]:
        """The lost sends the text being sent may be: not one the feed shows posted, unless
        its copy is what goes again (handed back, unedited). Typed anew, the same words are a
        new message: matched to the landed send, they went under its key and the daemon
        replayed the old turn instead of queueing the new one."""
        model, me = self.model, self.me
        if model is None or model.conversation_id != conversation_id or me is None:
            return earlier
        copies = {text.strip() for text in handed_back}
        return [u for u in earlier
                if u.text.strip() in copies or not landed(u, model.turns, me.device_id)]

    # -- tool approvals ----------------------------------------------------------------------

    def _show_approvals(self, model: ConversationModel) -> None:
        panel = self.approval_panel
        had = panel.current
        panel.show_approvals(model.approvals(), self._key_for("decide_tool(True)"),
                             self._key_for("decide_tool(False)"))
        if (had is None) != (panel.current is None):
            self.refresh_bindings()  # the approve/deny keys appear or go in the footer

    def _key_for(self, action: str) -> str:
        for active in self.active_bindings.values():
            if active.binding.action == action:
                return self.app.get_key_display(active.binding)
        return action

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "decide_tool":
            return self.approval_panel.current is not None
        return True

    def action_decide_tool(self, approve: bool) -> None:
        approval = self.approval_panel.current
        if approval is None:
            self.notify("No tool call is waiting for approval.")
            return
        if self.approval_panel.just_shown():
            # It replaced another a moment ago: the key may have been meant for that one.
            self.notify(f"{approval.tool}: this call has just appeared; read it, then press "
                        "the key again.", severity="warning")
            return
        self.decide_tool(approval.run_id, approval.call_id, approval.tool, approve)

    @work(group="approval", exit_on_error=False)
    async def decide_tool(self, run_id: str, call_id: str, tool: str, approve: bool) -> None:
        """Answer from this device; the feed then shows the decision on every device."""
        try:
            await self.client.decide_approval(run_id, call_id, "approve" if approve else "deny")
        except Conflict as exc:  # another device (or the timeout) decided first: it names who
            self.notify(f"{tool}: {exc.message}", severity="warning")
        except ApiError as exc:
            self.notify(f"{tool}: the decision was not recorded: {describe(exc)}",
                        severity="error")

    # -- actions -----------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.model is None:
            self.notify("No conversation is open.")
            return
        self.stop(self.model)

    @work(group="stop", exit_on_error=False)
    async def stop(self, model: ConversationModel) -> None:
        try:
            result = await self.client.stop_conversation(model.conversation_id)
        except ApiError as exc:
            self.notify(f"Stop failed: {describe(exc)}", severity="error")
            return
        await self.render_changes(model, model.note_stop(result))
        if not result.flagged and not result.cancelled:
            self.notify("Nothing was running or queued.")
        else:
            parts = []
            if result.flagged:
                parts.append("the running turn is stopping")
            if result.cancelled:
                parts.append(f"{len(result.cancelled)} queued turn(s) cancelled")
            self.notify("Stop sent: " + ", ".join(parts) + ".")

    def action_new_conversation(self) -> None:
        self.new_conversation()

    @work(group="conversations", exit_on_error=False)
    async def new_conversation(self) -> None:
        try:
            created = await self.client.create_conversation(
                "", model=self.next_model or self.app.settings.model)
        except ApiError as exc:
            self.notify(f"Could not create a conversation: {describe(exc)}", severity="error")
            return
        await self._refresh_list()
        await self.open_conversation(created.id)
        self.composer.focus()

    def action_rename_conversation(self) -> None:
        model = self.model
        if model is None:
            return

        def renamed(title: str | None) -> None:
            if title is not None:
                self.rename(model, title)

        self.app.push_screen(TextPrompt("Rename conversation", model.title, "a title"), renamed)

    @work(group="conversations", exit_on_error=False)
    async def rename(self, model: ConversationModel, title: str) -> None:
        try:
            renamed = await self.client.rename_conversation(model.conversation_id, title)
        except ApiError as exc:
            self.notify(f"Rename failed: {describe(exc)}", severity="error")
            return
        model.title = renamed.title
        self.sub_title = renamed.title or "Untitled conversation"
        await self._refresh_list()

    def action_search(self) -> None:
        def chosen(hit: SearchHit | None) -> None:
            if hit is None:
                return
            model = self.model
            if model is not None and model.conversation_id == hit.conversation_id:
                if hit.message_id is not None:
                    self.jump_to(model, hit.message_id)
            else:
                self._jump_to = hit.message_id  # once its snapshot is in (None: nothing to)
                self.action_open(hit.conversation_id)

        self.app.push_screen(SearchScreen(self.client), chosen)

    def action_copy_answer(self) -> None:
        text = self.model.last_answer() if self.model else None
        if not text:
            self.notify("No answer to copy yet.")
            return
        self.copy(text, "the last answer")

    def action_copy_code(self) -> None:
        if self.model is not None:
            for turn in reversed(self.model.turn_list()):
                code = last_code_block(turn.text)
                if code is not None:
                    self.copy(code, "the last code block")
                    return
        self.notify("No code block in the answers.")

    def copy(self, text: str, what: str) -> None:
        """OSC 52 to the terminal's clipboard, and a file for terminals that ignore it."""
        self.app.copy_to_clipboard(text)
        path = clipboard_file()
        try:
            # Only this user may read it: a copy can be a pairing line or a private answer.
            replace_file(path, text, private_dirs=True)
        except OSError:
            self.notify(f"Copied {what} ({len(text)} characters).")
            return
        self.notify(f"Copied {what} ({len(text)} characters); also saved to {path}.")

    def action_export(self) -> None:
        if self.model is not None:
            self.export(self.model)

    @work(group="export", exit_on_error=False)
    async def export(self, model: ConversationModel) -> Path | None:
        try:
            markdown = await self.client.export_conversation(model.conversation_id)
        except ApiError as exc:
            self.notify(f"Export failed: {describe(exc)}", severity="error")
            return None
        path = export_directory(self.app.settings) / export_name(model.title,
                                                                 model.conversation_id)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Whole or not at all, 0600 (a transcript is private; the default directory is the
            # working one, often shared), and never through a link planted at its name.
            replace_file(path, markdown)
        except OSError as exc:
            self.notify(f"Export failed: {exc}", severity="error")
            return None
        self.notify(f"Exported to {path}", title="Export")
        return path

    def action_toggle_sidebar(self) -> None:
        self.conversation_list.toggle_class("-hidden")

    def action_focus_list(self) -> None:
        self.conversation_list.remove_class("-hidden")
        self.conversation_list.focus()

    def action_switch(self, step: int) -> None:
        target = self.conversation_list.neighbour(step)
        if target is not None:
            self.action_open(target)

    def action_open(self, conversation_id: str) -> None:
        self.run_worker(self.open_conversation(conversation_id), group="open", exclusive=True,
                        exit_on_error=False)

    @on(OptionList.OptionSelected, "#conversations")
    def _picked(self, event: OptionList.OptionSelected) -> None:
        if event.option.id == MORE:  # the list grows by a page and stays so at each refresh
            self._list_size += LIST_SIZE
            self._refresh_list_quietly()
        elif event.option.id:
            self.action_open(event.option.id)
            self.composer.focus()
