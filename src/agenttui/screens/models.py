"""The model picker: what the daemon's providers offer, usable ones selectable, the others shown
with the reason they cannot run. Answers the chosen name, "" for the daemon's default, or None.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from agenttui.models import Models

DEFAULT_OPTION = "\x00default"  # no model name can hold a NUL


def model_options(models: Models, current: str | None) -> list[Option]:
    """One option per offer (literal text: names come from the daemon's config), default first."""
    mark = "● " if current is None else "  "
    options = [Option(Text(f"{mark}the daemon's default ({models.default_model})"),
                       id=DEFAULT_OPTION)]
    for offer in models.offers:
        mark = "● " if offer.name == current else "  "
        label = Text(f"{mark}{offer.name}")
        label.append(f"  {offer.kind}", style="dim")
        if not offer.usable:
            label.append(f"  — {offer.reason or 'cannot be used now'}", style="dim italic")
        options.append(Option(label, id=offer.name, disabled=not offer.usable))
    return options


class ModelPicker(ModalScreen[str | None]):
    DEFAULT_CSS = """
    ModelPicker { align: center middle; }
    ModelPicker > Vertical { width: 90; height: auto; max-height: 80%; padding: 1 2;
                             background: $panel; border: tall $accent; }
    ModelPicker OptionList { height: auto; max-height: 20; }
    ModelPicker Label { margin-bottom: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="models.cancel")]

    def __init__(self, models: Models, current: str | None, what: str) -> None:
        super().__init__()
        self.models = models
        self.current = current
        self.what = what

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(Text(f"Model for {self.what} (Enter picks, Esc cancels)"))
            yield OptionList(*model_options(self.models, self.current), id="models")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        options.focus()
        wanted = self.current or DEFAULT_OPTION
        for index in range(options.option_count):
            if options.get_option_at_index(index).id == wanted:
                options.highlighted = index

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        chosen = event.option.id
        self.dismiss("" if chosen == DEFAULT_OPTION else chosen)

    def action_cancel(self) -> None:
        self.dismiss(None)
