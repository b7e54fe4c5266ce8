"""F1: every key (as currently mapped) and how several devices share a conversation."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

ABOUT = """
### Several devices, one conversation

- The bar under the transcript is the **server's** view: the state (idle, running, queued,
  cancelling), which device asked for the running turn, which agentd worker executes it and how
  long its lease has left, and which devices are attached right now.
- A message sent while a turn runs is **queued** and runs next, on whatever device sent it.
- **Stop** asks the server to stop the conversation: the running turn ends `cancelled` with its
  partial answer kept, queued turns are cancelled and their text goes back to the composer of the
  device that wrote it.
- If the connection drops, the client reconnects by itself and resumes from the last event it
  saw: nothing is shown twice or lost. Closing the TUI never stops a turn.
- **Alt+↑/↓** select a message; then **F3** forks a new conversation up to it, **Ctrl+G** cancels
  it if it is a queued turn. **F4** retries and **F5** edits the latest turn: the old exchange
  stays, marked superseded. **F9** picks the conversation's model. Archive and delete are in the
  command palette; every attached device sees them at once.

Keys are remapped in the config file, under `[keys]` (binding id = keys).
"""


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; height: 90%; background: $panel;
                                  border: tall $accent; padding: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,f1,q", "close", "Close", id="help.close")]

    def __init__(self, keys: list[tuple[str, str, str]]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        rows = "\n".join(f"| `{key}` | {description} | `{binding_id}` |"
                         for key, description, binding_id in self.keys)
        text = (f"## agenttui keys\n\n| key | action | binding id |\n|---|---|---|\n{rows}\n"
                f"{ABOUT}")
        with VerticalScroll():
            yield Markdown(text)

    def action_close(self) -> None:
        self.dismiss(None)
