"""Garbage collection kept out of the way of keystrokes, as Textual does while it scrolls.

A long session holds many objects (widgets, rendered lines, transcript pages); a full
collection of them takes 100–300 ms on a small machine, and Python starts one whenever its
counters say so — in the middle of typing or paging. So while keys arrive (typing, PageUp after
PageUp) automatic collection is paused, and it resumes once no key has come for IDLE_S: Python
then collects as it always does, at a moment nobody waits for a frame. A burst that never ends
still gets a collection every MAX_PAUSE_S. What exists when the app starts (imports, the first
screen) is frozen (gc.freeze), so no collection rescans it.
"""

from __future__ import annotations

import gc
import time

IDLE_S = 1.0  # no key for this long: the burst is over
MAX_PAUSE_S = 30.0  # the longest automatic collection stays paused, keys or not


class IdleCollector:
    def __init__(self) -> None:
        self._paused_at: float | None = None
        self._last_input = time.monotonic()
        self.resumed = 0

    def start(self) -> None:
        gc.collect()
        gc.freeze()

    def touch(self) -> None:
        """A key arrived: no automatic collection until the keys stop."""
        self._last_input = time.monotonic()
        if self._paused_at is None and gc.isenabled():
            gc.disable()
            self._paused_at = self._last_input

    def tick(self) -> None:
        if self._paused_at is None:
            return
        now = time.monotonic()
        if now - self._last_input >= IDLE_S:
            self._resume()
        elif now - self._paused_at >= MAX_PAUSE_S:
            self._resume()
            gc.collect()  # bounded memory through a burst that does not stop

    def _resume(self) -> None:
        self._paused_at = None
        gc.enable()
        self.resumed += 1

    def stop(self) -> None:
        if self._paused_at is not None:
            self._resume()
        gc.unfreeze()
