"""An Alt+letter that nothing binds is Esc then the letter (agenttui.escape_keys): what a
terminal sends for both, which arrive as one key when typed quickly or over SSH."""

from __future__ import annotations

import pytest
from textual import events

from agenttui.escape_keys import esc_then_character


def keys(split: tuple[events.Key, events.Key] | None) -> list[tuple[str, str | None]] | None:
    return None if split is None else [(k.key, k.character) for k in split]


@pytest.mark.parametrize(("key", "character", "expected"), [
    ("alt+a", "a", [("escape", "\x1b"), ("a", "a")]),
    ("alt+shift+a", "A", [("escape", "\x1b"), ("A", "A")]),
    ("alt+7", "7", [("escape", "\x1b"), ("7", "7")]),
])
def test_an_unbound_alt_letter_is_esc_then_the_letter(
        key: str, character: str, expected: list[tuple[str, str]]) -> None:
    assert keys(esc_then_character(events.Key(key, character), bound={})) == expected


@pytest.mark.parametrize(("key", "character"), [
    ("alt+o", "o"),  # bound: the binding decides
    ("a", "a"),  # not an Alt key
    ("alt+up", None),  # not a character
    ("alt+a", None),  # no character given (a key sent by name)
    ("ctrl+a", "\x01"),
])
def test_other_keys_are_left_alone(key: str, character: str | None) -> None:
    assert esc_then_character(events.Key(key, character), bound={"alt+o": None}) is None
