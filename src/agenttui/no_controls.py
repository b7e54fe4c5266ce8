"""Text from the daemon never drives the terminal: control characters are dropped as lines are
drawn.

Answers, tool results, other devices' questions, titles and device names come from elsewhere.
Rich and Textual strip only a few controls (BEL, BS, VT, FF, CR) from what they draw; an ESC
went to the terminal as it was, and `ESC ] 52 ; c ; …` set the clipboard, `ESC [ 2 J` cleared
the screen, `ESC ] 0 ; …` retitled the window. One line filter sees every line every widget
draws, so no place that shows such text can forget it. Controls take no cell on the screen, so
dropping them leaves the layout as it was measured.
"""

from __future__ import annotations

from rich.segment import Segment
from textual.color import Color
from textual.filter import LineFilter

# C0 (tab and newline included: a drawn line holds neither), DEL and C1.
_DROPPED = dict.fromkeys([*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)])


def without_controls(text: str) -> str:
    return text.translate(_DROPPED)


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
