"""The command palette is built from the key bindings: each entry runs its binding's action and
shows its tooltip, so a key and its palette entry can never do different things."""

from __future__ import annotations

from textual.binding import Binding

from agenttui.app import PALETTE_TITLES, SCREEN_BINDINGS


def test_every_palette_entry_is_a_binding_with_a_tooltip() -> None:
    bindings = {b.id: b for group in SCREEN_BINDINGS for b in group if isinstance(b, Binding)}
    assert set(PALETTE_TITLES) <= set(bindings), set(PALETTE_TITLES) - set(bindings)
    for binding_id in PALETTE_TITLES:
        assert bindings[binding_id].tooltip, f"{binding_id}: no tooltip for its palette entry"
    assert len(set(PALETTE_TITLES.values())) == len(PALETTE_TITLES)  # titles tell them apart
