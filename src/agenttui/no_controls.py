"""Text from the daemon never drives the terminal: control characters are dropped as lines are
drawn.

Answers, tool results, other devices' questions, titles and device names come from elsewhere.
Rich and Textual strip only a few controls (BEL, BS, VT, FF, CR) from what they draw; an ESC
went to the terminal as it was, and `ESC ] 52 ; c ; …` set the clipboard, `ESC [ 2 J` cleared
the screen, `ESC ] 0 ; …` retitled the window. One line filter sees every line every widget
draws, so no place that shows such text can forget it. Controls take no cell on the screen, so
dropping them leaves the layout as it was measured (a drawn line holds no newline or tab, which
the rule keeps).
"""

from __future__ import annotations

from rich.segment import Segment
from textual.color import Color
from textual.filter import LineFilter

# What `agenttui ask` drops from what it prints to a terminal: the same rule for both.
from agenttui.ask import without_controls


class DropControls(LineFilter):
    """Removes control characters from the text of every segment drawn (a segment that is a
    control of Textual's own, such as a cursor move, is left alone)."""

    def apply(self, segments: list[Segment], background: Color) -> list[Segment]:
        cleaned: list[Segment] | None = None
        for index, segment in enumerate(segments):
            text = segment.text
            # isprintable() is False for every control (and for a few other characters, which
            # the translation then leaves as they are): the common line costs one C-level scan.
            if segment.control is None and not text.isprintable():
                kept = without_controls(text)
                if kept != text:
                    if cleaned is None:
                        cleaned = segments[:index]
                    cleaned.append(Segment(kept, segment.style))
                    continue
            if cleaned is not None:
                cleaned.append(segment)
        return segments if cleaned is None else cleaned
