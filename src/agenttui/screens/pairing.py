"""Pair another device: a one-time code from the server and the exact line to run elsewhere."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static


class PairingScreen(ModalScreen[None]):
    """Shows the `agenttui login` line; `c` copies it, Escape closes."""

    DEFAULT_CSS = """
    PairingScreen { align: center middle; }
    PairingScreen > Vertical { width: 90%; max-width: 120; height: auto; padding: 1 2;
                               background: $panel; border: tall $accent; }
    PairingScreen #pairing-command { margin: 1 0; padding: 0 1; background: $surface; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "close", "Close", id="pairing.close"),
        Binding("c", "copy", "Copy the line", id="pairing.copy")]

    def __init__(self, pairing: dict[str, Any]) -> None:
        super().__init__()
        self.pairing = pairing

    @property
    def command(self) -> str:
        return str(self.pairing["command"])

    def compose(self) -> ComposeResult:
        fingerprint = self.pairing.get("fingerprint")
        with Vertical():
            yield Label(f"Pairing code {self.pairing['code']} — valid once, until "
                        f"{self.pairing['expires_at']}. On the other machine run:")
            yield Static(self.command, id="pairing-command", markup=False)
            yield Label(f"It pins this server's certificate {fingerprint}." if fingerprint else
                        "This server speaks plain HTTP: the new device's token crosses the "
                        "network unencrypted.")
            yield Label("c copies the line · Escape closes", classes="dim")

    def action_copy(self) -> None:
        from agenttui.screens.main import MainScreen  # main imports this screen

        main = self.app.get_screen("main")
        if isinstance(main, MainScreen):
            main.copy(self.command, "the login line")

    def action_close(self) -> None:
        self.dismiss(None)
