"""A turn's max_run_s clock stands still while it waits for a person's approval, for at most
approval_timeout_s in all: a turn still ends within max_run_s + approval_timeout_s however
many calls it asks about."""

from __future__ import annotations

from typing import Any

import pytest

from agentd import executor


def test_approval_waits_stop_the_clock_up_to_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(executor.time, "monotonic", lambda: now[0])
    nothing: Any = None
    turn = executor._Turn(nothing, nothing, nothing, max_run_s=10, max_pause_s=5,
                          started=now[0])
    now[0] += 2
    assert turn.deadline_left() == 8
    with turn.waiting_for_a_person():
        now[0] += 4
        assert turn.deadline_left() == 8  # a person's time
    now[0] += 1
    assert turn.deadline_left() == 7
    with turn.waiting_for_a_person():
        now[0] += 3  # 7 s of waits in all, 5 of them left out
        assert turn.deadline_left() == 5
    now[0] += 5
    assert turn.deadline_left() == 0
