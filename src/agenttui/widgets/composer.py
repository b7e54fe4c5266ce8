"""The composer: Enter sends; Ctrl+J (or Shift+Enter / Alt+Enter where the terminal sends them)
starts a new line. Drafts handed back by a stop land here, never silently overwriting text.
"""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import TextArea


class Composer(TextArea):
    DEFAULT_CSS = """
    Composer { height: auto; min-height: 3; max-height: 10; border: tall $surface-lighten-2; }
    Composer:focus { border: tall $accent; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "submit", "Send", id="send", priority=True),
        Binding("ctrl+j,shift+enter,alt+enter", "newline", "Newline", id="newline",
                key_display="^j", priority=True),
    ]

    class Submitted(Message):
        def __init__(self, composer: Composer, text: str) -> None:
            super().__init__()
            self.composer = composer
            self.text = text

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, tab_behavior="focus", show_line_numbers=False,
                         placeholder="Message — Enter sends · Ctrl+J new line",
                         **kwargs)  # type: ignore[arg-type]

    def action_submit(self) -> None:
        text = self.text
        if text.strip():
            self.post_message(self.Submitted(self, text))

    def action_newline(self) -> None:
        self.insert("\n")

    def put_back(self, text: str) -> None:
        """Return text to the composer (a failed send, a draft); what is typed stays too."""
        current = self.text
        if current.strip() and text.strip() not in current:
            self.text = f"{text}\n\n{current}"
        elif not current.strip():
            self.text = text
        self.move_cursor(self.document.end)
