"""The chat screen's conversation life cycle: a selection that moves through the transcript, and
fork, retry, edit-and-resend, cancel one queued turn, the model picker, archive and delete.

Every action is a request to the daemon; what it changed reaches this device (and every other
attached one) through the conversation feed, like everything else on screen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from textual import work
from textual.binding import Binding, BindingType
from textual.screen import Screen

from agenttui.client import AgentClient, ApiError, describe, outcome_unknown
from agenttui.conversation import Changes, ConversationModel, Turn
from agenttui.screens.confirm import Confirm
from agenttui.screens.edit import EditPrompt
from agenttui.screens.models import ModelPicker

if TYPE_CHECKING:
    from agenttui.app import AgentTUI
    from agenttui.widgets.composer import Composer
    from agenttui.widgets.conversation_list import ConversationList
    from agenttui.widgets.ownership_bar import OwnershipBar
    from agenttui.widgets.transcript import Transcript

QUESTION, ANSWER = "question", "answer"


class Selection(NamedTuple):
    key: str  # the turn
    part: str  # QUESTION or ANSWER


def selectable(model: ConversationModel) -> list[Selection]:
    """Every message a selection can rest on, top to bottom: each turn's question and answer."""
    items = []
    for turn in model.turn_list():
        if turn.question_id:
            items.append(Selection(turn.key, QUESTION))
        if turn.answer_id:
            items.append(Selection(turn.key, ANSWER))
    return items


def message_of(turn: Turn, part: str) -> str | None:
    return turn.question_id if part == QUESTION else turn.answer_id


def latest_turn(model: ConversationModel) -> Turn | None:
    """The turn a retry or an edit without a selection applies to (as the server judges it)."""
    for turn in reversed(model.turn_list()):
        if turn.question_id and not turn.superseded and turn.question_status != "draft":
            return turn
    return None


class LifecycleScreen(Screen[None]):
    DEFAULT_CSS = """
    LifecycleScreen TurnView > .question.-selected { background: $accent 35%; }
    LifecycleScreen TurnView > AnswerView.-selected { background: $accent 15%;
                                                       border-left: thick $accent; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("alt+up", "select(-1)", "Select previous message", id="select_previous",
                show=False),
        Binding("alt+down", "select(1)", "Select next message", id="select_next", show=False),
        Binding("f3", "fork", "Fork", id="fork", show=False,
                tooltip="A new conversation with the transcript up to the selected message "
                        "(Alt+↑/↓ selects)"),
        Binding("f4", "retry", "Retry", id="retry", show=False,
                tooltip="Run the last question again (the old answer stays, marked "
                        "superseded)"),
        Binding("f5", "edit", "Edit & resend", id="edit", show=False,
                tooltip="Change the last question and send it again"),
        Binding("ctrl+g", "cancel_queued", "Cancel queued turn", id="cancel_queued",
                show=False, tooltip="The selected queued turn (else the last one): its text "
                                    "goes back to its author"),
        Binding("f9", "choose_model", "Model", id="choose_model", show=False,
                tooltip="The model this conversation's turns use"),
    ]

    app: AgentTUI
    model: ConversationModel | None
    selection: Selection | None = None
    showing_archived = False  # the list shows archived conversations instead
    next_model: str | None = None  # chosen before any conversation exists: for the next one
    _hinting = False  # the bar shows the selection's keys
    _marked: Selection | None = None  # the message marked on screen

    def __init__(self) -> None:
        super().__init__()
        self.deleting: set[str] = set()  # conversations this device asked to delete

    # -- what the chat screen provides ---------------------------------------------------------

    @property
    def client(self) -> AgentClient:
        return self.app.client

    @property
    def transcript(self) -> Transcript:
        raise NotImplementedError

    @property
    def composer(self) -> Composer:
        raise NotImplementedError

    @property
    def bar(self) -> OwnershipBar:
        raise NotImplementedError

    @property
    def conversation_list(self) -> ConversationList:
        raise NotImplementedError

    async def open_conversation(self, conversation_id: str) -> None:
        raise NotImplementedError

    async def render_changes(self, model: ConversationModel, changes: Changes) -> None:
        raise NotImplementedError

    async def reveal(self, key: str) -> None:
        raise NotImplementedError

    async def _refresh_list(self) -> list[Any]:
        raise NotImplementedError

    # -- selection -----------------------------------------------------------------------------

    def action_select(self, step: int) -> None:
        """Move the selection up or down the transcript; down past the last message clears it."""
        model = self.model
        items = selectable(model) if model is not None else []
        if not items:
            self.notify("No message to select yet.")
            return
        if self.selection in items:
            index = items.index(self.selection) + step
        else:
            index = len(items) - 1 if step < 0 else len(items)
        self.selection = items[max(index, 0)] if index < len(items) else None
        self.apply_selection(scroll=True)

    def apply_selection(self, *, scroll: bool = False, rebuilt: bool = False) -> None:
        """Mark the selected message; only the views whose mark changes are touched (this runs
        on every redraw, streaming included), all of them only after a rebuild."""
        model = self.model
        selection = self.selection
        if selection is not None:
            turn = model.turns.get(selection.key) if model is not None else None
            if turn is None or not message_of(turn, selection.part):
                selection = self.selection = None
        if selection != self._marked or rebuilt:
            self._mark(self._marked, False)
            self._mark(selection, True)
            self._marked = selection
        if selection is None or model is None:
            if self._hinting:
                self._hinting = False
                self.bar.show(model)
            return
        self._hinting = True
        view = self.transcript.views.get(selection.key)
        if view is not None and scroll:
            target = view.question if selection.part == QUESTION else view.answer
            self.transcript.scroll_to_widget(target, animate=False)
        elif view is None and scroll:  # scrolled out of the mounted window: mount it
            self.run_worker(self.reveal(selection.key), group="reveal", exit_on_error=False)
        self.bar.show(model, f"selected: the {selection.part} · F3 fork from here · "
                             f"F4 retry · F5 edit · Ctrl+G cancel if queued · Alt+↓ to leave")

    def _mark(self, selection: Selection | None, on: bool) -> None:
        view = self.transcript.views.get(selection.key) if selection is not None else None
        if view is not None and selection is not None:
            part = view.question if selection.part == QUESTION else view.answer
            part.set_class(on, "-selected")

    def selected_turn(self) -> Turn | None:
        if self.model is None or self.selection is None:
            return None
        return self.model.turns.get(self.selection.key)

    def _clear_selection(self) -> None:
        self.selection = None
        self.apply_selection()

    # -- fork ----------------------------------------------------------------------------------

    def action_fork(self) -> None:
        model = self.model
        if model is None:
            self.notify("No conversation is open.")
            return
        turn, message_id = self.selected_turn(), None
        if turn is not None and self.selection is not None:
            message_id = message_of(turn, self.selection.part)
        else:  # no selection: fork the whole conversation as it stands (its last answer)
            for candidate in reversed(model.turn_list()):
                if candidate.finished or candidate.run_id is None:
                    message_id = candidate.answer_id or candidate.question_id
                    if message_id:
                        break
        if not message_id:
            self.notify("Nothing to fork from yet: select a message of a finished turn.")
            return
        self.fork(model, message_id)

    @work(group="lifecycle", exit_on_error=False)
    async def fork(self, model: ConversationModel, message_id: str) -> None:
        try:
            copy = await self.client.fork_conversation(model.conversation_id, message_id)
        except ApiError as exc:
            self.notify(f"Fork failed: {describe(exc)}", severity="error")
            return
        self.selection = None
        await self.open_conversation(copy.id)
        await self._refresh_list()
        self.notify(f"You are in the copy: {copy.title}. The original is unchanged.",
                    title="Forked")

    # -- retry and edit ------------------------------------------------------------------------

    def _retry_target(self) -> Turn | None:
        if self.model is None:
            self.notify("No conversation is open.")
            return None
        turn = self.selected_turn() or latest_turn(self.model)
        if turn is None or not turn.question_id:
            self.notify("Nothing to retry yet.")
            return None
        return turn

    def action_retry(self) -> None:
        turn = self._retry_target()
        if turn is not None and self.model is not None and turn.question_id:
            self.retry(self.model, turn.question_id, None)

    def action_edit(self) -> None:
        turn = self._retry_target()
        model = self.model
        if turn is None or model is None or not turn.question_id:
            return
        question_id = turn.question_id

        def edited(text: str | None) -> None:
            if text is not None and text.strip():
                self.retry(model, question_id, text)

        self.app.push_screen(EditPrompt(turn.question), edited)

    @work(group="lifecycle", exit_on_error=False)
    async def retry(self, model: ConversationModel, question_id: str,
                    content: str | None) -> None:
        try:
            run = await self.client.retry(model.conversation_id, question_id, content=content,
                                          params=self.app.settings.params or None)
        except ApiError as exc:
            if content is None:
                self.notify(f"Retry refused: {describe(exc)}", severity="error")
                return
            # The editor is closed: what was written in it must not go with it.
            self.composer.put_back(content, unless_here=False)
            if outcome_unknown(exc):
                self.notify(f"The edit's answer was lost ({describe(exc)}); it may have been "
                            "applied. Your text is in the composer: check the transcript "
                            "before you send it.", severity="error", title="Edit uncertain")
            else:
                self.notify(f"Edit refused: {describe(exc)}. Your text is in the composer.",
                            severity="error", title="Edit refused")
            return
        model.note_created(run.run_id)
        self._clear_selection()
        await self.render_changes(model, Changes(turns={run.run_id}, bar=True))
        self.notify("Sent again; the old exchange stays above, marked superseded.",
                    title="Edited" if content is not None else "Retrying")

    # -- cancel one queued turn ----------------------------------------------------------------

    def action_cancel_queued(self) -> None:
        model = self.model
        if model is None:
            self.notify("No conversation is open.")
            return
        turn = self.selected_turn()
        if turn is None or not turn.queued:
            queued = model.queued_turns
            mine = [t for t in queued if model.mine(t)]
            candidates = mine or queued
            turn = candidates[-1] if candidates else None
        if turn is None or turn.run_id is None:
            self.notify("No queued turn to cancel.")
            return
        self.cancel_queued(model, turn.run_id)

    @work(group="lifecycle", exit_on_error=False)
    async def cancel_queued(self, model: ConversationModel, run_id: str) -> None:
        try:
            # Only while queued: the turn picked may have started since, and its answer must go
            # on (docs/tui.md: the running turn and the other queued ones go on).
            result = await self.client.cancel_run(run_id, queued_only=True)
        except ApiError as exc:
            self.notify(f"Cancel failed: {describe(exc)}", severity="error")
            return
        await self.render_changes(model, model.note_stop(result))
        if result.cancelled:
            turn = model.turns.get(run_id)
            whose = "your composer" if turn is not None and model.mine(turn) else \
                "the composer of the device that asked it"
            self.notify(f"Queued turn cancelled; its text went back to {whose}.")
        else:
            self.notify("That turn had already started (stop it with Esc) or ended; it was "
                        "left alone.")

    # -- model ---------------------------------------------------------------------------------

    def action_choose_model(self) -> None:
        self.choose_model(self.model)

    @work(group="lifecycle", exit_on_error=False)
    async def choose_model(self, model: ConversationModel | None) -> None:
        try:
            models = await self.client.list_models()
        except ApiError as exc:
            self.notify(f"Could not list the models: {describe(exc)}", severity="error")
            return
        self.bar.default_model = models.default_model
        current = model.model_name if model is not None else self.next_model
        what = "this conversation" if model is not None else "the next conversation"

        def chosen(name: str | None) -> None:
            if name is not None:
                self.set_model(model, name or None)

        self.app.push_screen(ModelPicker(models, current, what), chosen)

    @work(group="lifecycle", exit_on_error=False)
    async def set_model(self, model: ConversationModel | None, name: str | None) -> None:
        if model is None:
            self.next_model = name
            self.notify(f"New conversations will use {name or 'the default model'}.")
            return
        try:
            updated = await self.client.update_conversation(model.conversation_id, model=name)
        except ApiError as exc:
            self.notify(f"Model not changed: {describe(exc)}", severity="error")
            return
        model.model_name = updated.model
        self.bar.show(model)
        self.notify(f"This conversation now uses {updated.model or 'the default model'}.")

    # -- archive and delete --------------------------------------------------------------------

    def action_archive(self, archived: bool = True) -> None:
        if self.model is None:
            self.notify("No conversation is open.")
            return
        self.archive(self.model, archived)

    @work(group="lifecycle", exit_on_error=False)
    async def archive(self, model: ConversationModel, archived: bool) -> None:
        try:
            updated = await self.client.update_conversation(model.conversation_id,
                                                            archived=archived)
        except ApiError as exc:
            self.notify(f"{'Archive' if archived else 'Restore'} failed: {describe(exc)}",
                        severity="error")
            return
        model.archived_at = updated.archived_at
        self.bar.show(model)
        await self._refresh_list()
        self.notify("Archived: hidden from the list (palette: Show archived conversations)."
                    if archived else "Restored to the conversation list.")

    def action_toggle_archived(self) -> None:
        self.showing_archived = not self.showing_archived
        self.conversation_list.border_title = \
            "Archived" if self.showing_archived else "Conversations"
        self.run_worker(self._refresh_list(), group="list", exclusive=True, exit_on_error=False)

    def action_delete(self) -> None:
        model = self.model
        if model is None:
            self.notify("No conversation is open.")
            return
        title = model.title or "this untitled conversation"

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.delete(model)

        self.app.push_screen(Confirm(f"Delete “{title}” for every device? Its running turn "
                                     f"stops and its transcript is gone for good.", "Delete"),
                             confirmed)

    @work(group="lifecycle", exit_on_error=False)
    async def delete(self, model: ConversationModel) -> None:
        # Its feed may say "deleted" before the answer comes: either way it was this device.
        self.deleting.add(model.conversation_id)
        try:
            await self.client.delete_conversation(model.conversation_id)
        except ApiError as exc:
            self.deleting.discard(model.conversation_id)
            self.notify(f"Delete failed: {describe(exc)}", severity="error")
            return
        await self.conversation_gone(model)

    async def conversation_gone(self, model: ConversationModel) -> None:
        """The open conversation was deleted (here, or on another device): leave it."""
        if model is not self.model:
            return
        here = model.conversation_id in self.deleting
        self.model = None
        self.selection = None
        await self.transcript.reset("This conversation was deleted. Pick another, or type to "
                                    "start a new one.")
        self.bar.show(None, "○ conversation deleted")
        self.notify("Conversation deleted." if here else
                    "This conversation was deleted on another device.", title="Deleted")
        remaining = [c for c in await self._refresh_list() if c.id != model.conversation_id]
        if remaining:
            await self.open_conversation(remaining[0].id)
