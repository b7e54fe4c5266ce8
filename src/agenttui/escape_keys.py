"""Esc and a letter that arrive in one read.

A terminal sends Alt+X as Esc followed by X, so Esc then a letter typed quickly, or delivered
together by an SSH link, reach the app as one key, alt+x. Textual has no way to tell them
apart: both are the same bytes. agenttui binds almost no Alt+letter keys, so an Alt+letter
that nothing binds is read as what was most likely typed: Esc (stop, close, cancel), then the
letter, which goes where a letter typed after that Esc would (the composer, or the dialog the
Esc left open). Without this the Esc was lost:
the composer took the letter, and the turn the Esc was meant to stop went on running.
"""

from __future__ import annotations

import re
from collections.abc import Container

from textual import events

# What Textual's key parser names Esc followed by a letter or a digit; other characters after
# Esc keep their own names, and the Esc before them is not reported at all.
_ALT_CHARACTER = re.compile(r"alt\+(?:shift\+)?[a-z0-9]")


def esc_then_character(event: events.Key,
                       bound: Container[str]) -> tuple[events.Key, events.Key] | None:
    """The two keys an unbound Alt+letter (or digit) stands for, Esc and the character; None
    for any other key, or one that a binding claims (`bound`: every bound key, as mapped)."""
    character = event.character
    if (not event.key.startswith("alt+") or not _ALT_CHARACTER.fullmatch(event.key)
            or event.key in bound or character is None or len(character) != 1
            or not character.isalnum()):
        return None
    # The names Textual's parser gives the two keys when they arrive apart.
    return events.Key("escape", "\x1b"), events.Key(character, character)
