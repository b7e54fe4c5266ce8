"""Edit a question and resend it: the composer's own keys (Enter sends, Ctrl+J new line) in a
modal, so what is being typed in the main composer stays untouched. Escape gives up."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label

from agenttui.widgets.composer import Composer


class EditPrompt(ModalScreen[str | None]):
    DEFAULT_CSS = """
    EditPrompt { align: center middle; }
    EditPrompt > Vertical { width: 90%; height: auto; padding: 1 2; background: $panel;
                            border: tall $accent; }
    EditPrompt Label { margin-bottom: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="edit.cancel")]

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(Text("Edit and resend (Enter resends · Ctrl+J new line · Esc cancels). "
                             "The old exchange stays, marked superseded."))
            yield Composer(id="edited")

    def on_mount(self) -> None:
        composer = self.query_one(Composer)
        composer.text = self.text
        composer.move_cursor(composer.document.end)
        composer.focus()

    @on(Composer.Submitted)
    def _resend(self, event: Composer.Submitted) -> None:
        event.stop()  # the main screen's composer handler must not send it as a new turn
        self.dismiss(event.text)

    def action_cancel(self) -> None:
        self.dismiss(None)
