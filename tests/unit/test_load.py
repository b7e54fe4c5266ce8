"""Admission by capacity (load.LoadMonitor): hold back while the last second's worst loop lag or
pool wait is past its bound, resume once both recovered, and say so once each way."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agentd.load import WINDOW_S, LoadMonitor
from agentd.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def monitor(clock: Clock) -> tuple[LoadMonitor, Metrics]:
    metrics = Metrics()
    return LoadMonitor(None, metrics, max_loop_lag_s=0.25, max_pool_wait_s=0.1,  # type: ignore[arg-type]
                       clock=clock), metrics


def test_overload_names_the_bound_exceeded_within_the_window() -> None:
    clock = Clock()
    load, metrics = monitor(clock)
    assert load.overload() is None
    load.record_loop_lag(0.2)
    assert load.overload() is None  # below the bound
    load.record_loop_lag(0.4)
    assert "event loop lag 400 ms > 250 ms (max_loop_lag_ms)" in (load.overload() or "")
    clock.now += WINDOW_S / 2
    load.record_loop_lag(0.001)
    assert load.overload() is not None  # the bad sample is still within the last second
    clock.now += WINDOW_S
    load.record_loop_lag(0.001)
    assert load.overload() is None
    load.record_pool_wait(0.3)
    assert "pool wait 300 ms > 100 ms (max_pool_wait_ms)" in (load.overload() or "")
    assert metrics.registry.get_sample_value("agentd_event_loop_lag_seconds_count") == 4
    assert metrics.registry.get_sample_value(
        "agentd_pool_wait_seconds_bucket", {"le": "0.5"}) == 1


def test_peaks_since_the_last_beat_are_taken_once() -> None:
    load, _ = monitor(Clock())
    load.record_loop_lag(0.05)
    load.record_loop_lag(0.02)
    load.record_pool_wait(0.01)
    assert load.take_peaks() == (0.05, 0.01)
    assert load.take_peaks() == (0.0, 0.0)


async def test_admission_holds_back_until_the_load_recovers_and_logs_once_each_way(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    load, metrics = monitor(clock)
    await asyncio.wait_for(load.admitted(), 1)  # not overloaded: at once
    load.record_loop_lag(2.0)
    caplog.set_level(logging.WARNING, logger="agentd.load")
    waiting = asyncio.create_task(load.admitted())
    for _ in range(5):  # more overloaded samples: still holding back, no new log line
        await asyncio.sleep(0)
        load.record_loop_lag(0.5)
    await asyncio.sleep(0)
    assert not waiting.done() and load.holding_back
    assert metrics.registry.get_sample_value("agentd_admission_holding_back") == 1
    clock.now += WINDOW_S + 0.01
    load.record_loop_lag(0.01)  # a calm second later
    await asyncio.wait_for(waiting, 1)
    assert not load.holding_back
    assert metrics.registry.get_sample_value("agentd_admission_holding_back") == 0
    assert metrics.registry.get_sample_value("agentd_admission_holds_total") == 1
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in messages] == ["holding back from claiming",
                                                   "claiming again"], messages
    assert caplog.records[0].reason.startswith("event loop lag 2000 ms")
