"""The composer: Enter sends; Ctrl+J (or Shift+Enter / Alt+Enter where the terminal sends them)
starts a new line. Drafts handed back by a stop land here, never silently overwriting text.
PageUp/PageDown page the transcript while the composer's own text fits in it.

Enter is handled here, in the order keys arrive, not as an app-level priority binding. Textual
checks priority bindings in the app's own message loop the moment a key is read, but forwards
every other key to the focused widget's queue: a line and its Enter read in one go (a paste
without bracketed paste, a laggy SSH link, `tmux send-keys`) would reach a priority binding
while the characters before it were still queued, and send an empty composer.
"""

from __future__ import annotations

from typing import Any, ClassVar

from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import TextArea
from textual.widgets.text_area import Edit, EditResult

# The composer's own actions, run when their key reaches the composer (never earlier).
OWN_ACTIONS = frozenset({"submit", "newline"})
SEPARATOR = "\n\n"


class Composer(TextArea):
    DEFAULT_CSS = """
    Composer { height: auto; min-height: 3; max-height: 10; border: tall $surface-lighten-2; }
    Composer:focus { border: tall $accent; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "submit", "Send", id="send"),
        Binding("ctrl+j,shift+enter,alt+enter", "newline", "Newline", id="newline",
                key_display="^j"),
    ]

    class Submitted(Message):
        """`handed_back`: the texts put back at the head of `text`, unedited (put_back), in
        order; what follows them was typed."""

        def __init__(self, composer: Composer, text: str,
                     handed_back: tuple[str, ...] = ()) -> None:
            super().__init__()
            self.composer = composer
            self.text = text
            self.handed_back = handed_back

    class PageTurned(Message):
        """PageUp (step -1) or PageDown (1) while the composer's text fits: for the transcript."""

        def __init__(self, step: int) -> None:
            super().__init__()
            self.step = step

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(soft_wrap=True, tab_behavior="focus", show_line_numbers=False,
                         placeholder="Message — Enter sends · Ctrl+J new line",
                         **kwargs)
        self._handed_back: list[str] = []  # texts put back, in order, leading the composer

    def action_cursor_page_up(self) -> None:
        if self._fits():
            self.post_message(self.PageTurned(-1))
        else:
            super().action_cursor_page_up()

    def action_cursor_page_down(self) -> None:
        if self._fits():
            self.post_message(self.PageTurned(1))
        else:
            super().action_cursor_page_down()

    def _fits(self) -> bool:
        """All of the text is in view: paging inside the composer would do nothing."""
        return self.virtual_size.height <= self.content_size.height

    async def _on_key(self, event: events.Key) -> None:
        # A key bound to send or newline (as remapped by the user) acts here, after every key
        # before it was inserted; TextArea would otherwise insert Enter as a line break.
        if not event.is_printable:
            active = self.screen.active_bindings.get(event.key)
            if active is not None and active.node is self and \
                    active.binding.action in OWN_ACTIONS:
                event.stop()
                event.prevent_default()
                await self.run_action(active.binding.action)
                return
        await super()._on_key(event)

    def action_submit(self) -> None:
        text = self.text
        if text.strip():
            handed_back = self._unedited_handed_back(text)
            # Cleared now, not when the screen gets the message: keys after this Enter are
            # already queued behind it and belong to the next message.
            self.clear()
            self._handed_back = []
            self.post_message(self.Submitted(self, text, handed_back))

    def action_newline(self) -> None:
        self.insert("\n")

    def edit(self, edit: Edit) -> EditResult:
        result = super().edit(edit)
        self._forget_edited_away()
        return result

    def load_text(self, text: str) -> None:
        super().load_text(text)
        self._forget_edited_away()

    def _forget_edited_away(self) -> None:
        """Text handed back, then deleted or changed, is no longer its copy: the same words
        typed anew are a new message, not the lost send again (under its key the daemon
        replays the old turn instead of queueing a new one). Only a change inside it counts:
        what is typed after it, key by key, passes through text that is neither it alone nor
        it and a blank line (its first newline), and the send decides on the whole."""
        if self._handed_back and not self.text.startswith(SEPARATOR.join(self._handed_back)):
            self._handed_back = []

    def _unedited_handed_back(self, text: str) -> tuple[str, ...]:
        """The texts handed back, if `text` still starts with them as they were put back
        (followed by nothing, or by a blank line and what was typed); else none."""
        block = SEPARATOR.join(self._handed_back)
        if self._handed_back and (text == block or text.startswith(block + SEPARATOR)):
            return tuple(self._handed_back)
        return ()

    def put_back(self, text: str, *, unless_here: bool = True) -> None:
        """Return text to the composer (a failed send, a draft); what is typed stays too.

        Texts handed back one after another stay in that order, ahead of what was typed since:
        drafts a stop returns come back in the order they were queued. A draft already here
        word for word (handed back before) is not added again; a send that failed always
        comes back (`unless_here=False`): its text may also be a paragraph of another one.
        """
        current = self.text
        paragraphs = {part.strip() for part in current.split(SEPARATOR)}
        if not text.strip() or (unless_here and text.strip() in paragraphs):
            return
        if self._unedited_handed_back(current):
            typed = current[len(SEPARATOR.join(self._handed_back)):]
        else:  # edited (or nothing handed back yet): start a new block
            self._handed_back = []
            typed = current
        self._handed_back.append(text)
        self.text = SEPARATOR.join(self._handed_back) + \
            (SEPARATOR + typed.lstrip("\n") if typed.strip() else "")
        self.move_cursor(self.document.end)
