"""Automatic garbage collection pauses while keys arrive and resumes when they stop (or after
the longest pause allowed), and the app gives Python its own pacing back when it ends."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from agenttui import idle_gc
from agenttui.idle_gc import IdleCollector


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[IdleCollector]:
    was_enabled = gc.isenabled()
    gc.enable()
    monkeypatch.setattr(idle_gc, "IDLE_S", 3600.0)
    monkeypatch.setattr(idle_gc, "MAX_PAUSE_S", 7200.0)
    collector = IdleCollector()
    collector.start()
    try:
        yield collector
    finally:
        collector.stop()
        assert gc.isenabled()
        if not was_enabled:
            gc.disable()


def test_keys_pause_collection_until_they_stop(collector: IdleCollector,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    collector.touch()
    assert not gc.isenabled()
    collector.tick()
    assert not gc.isenabled(), "keys still arriving: still paused"
    monkeypatch.setattr(idle_gc, "IDLE_S", 0.0)
    collector.tick()
    assert gc.isenabled() and collector.resumed == 1


def test_a_burst_that_never_stops_still_resumes(collector: IdleCollector,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    collector.touch()
    monkeypatch.setattr(idle_gc, "MAX_PAUSE_S", 0.0)
    collector.tick()
    assert gc.isenabled()


def test_stop_resumes_a_paused_collector(collector: IdleCollector) -> None:
    collector.touch()
    collector.stop()
    assert gc.isenabled()
