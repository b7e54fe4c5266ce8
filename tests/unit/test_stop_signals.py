"""Stop signals: the first starts the drain; a second Ctrl-C or SIGUSR1 cuts it short; repeated
SIGTERMs and SIGHUPs, which one stop often delivers twice, never do; a supervised worker is cut
short by its supervisor's SIGUSR1 only. Real signals to this process, on the test's loop."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest

from agentd import supervisor

# A signal after others: once its handler ran, theirs did (handlers run in delivery order).
PROBE = signal.SIGUSR2


class Signals:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.stop, self.hurry = asyncio.Event(), asyncio.Event()

    async def send(self, *signums: int) -> None:
        """Send the signals to this process; return once their handlers have run."""
        probed = asyncio.Event()
        self.loop.add_signal_handler(PROBE, probed.set)
        try:
            for signum in signums:
                os.kill(os.getpid(), signum)
            os.kill(os.getpid(), PROBE)
            await asyncio.wait_for(probed.wait(), 10)
        finally:
            self.loop.remove_signal_handler(PROBE)


@pytest.fixture
async def signals() -> AsyncIterator[Signals]:
    loop = asyncio.get_running_loop()
    handled = Signals(loop)
    try:
        yield handled
    finally:
        for signum in (*supervisor.STOP_SIGNALS, supervisor.HURRY_SIGNAL):
            loop.remove_signal_handler(signum)


async def test_a_second_ctrl_c_cuts_the_drain_short(signals: Signals) -> None:
    supervisor.on_stop_signals(signals.loop, signals.stop, signals.hurry)
    await signals.send(signal.SIGTERM)
    assert signals.stop.is_set() and not signals.hurry.is_set()
    await signals.send(signal.SIGINT)
    assert signals.hurry.is_set()


async def test_repeated_sigterms_and_sighups_are_one_stop(signals: Signals) -> None:
    supervisor.on_stop_signals(signals.loop, signals.stop, signals.hurry)
    await signals.send(signal.SIGTERM, signal.SIGTERM, signal.SIGTERM)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        await signals.send(signal.SIGHUP, signal.SIGHUP)
    assert signals.stop.is_set() and not signals.hurry.is_set()


@pytest.mark.parametrize("supervised", [False, True], ids=["alone", "supervised"])
async def test_sigusr1_stops_and_cuts_short_at_once(signals: Signals, supervised: bool) -> None:
    supervisor.on_stop_signals(signals.loop, signals.stop, signals.hurry, supervised=supervised)
    await signals.send(supervisor.HURRY_SIGNAL)
    assert signals.stop.is_set() and signals.hurry.is_set()


async def test_a_supervised_worker_takes_every_stop_signal_as_one_stop(
        signals: Signals) -> None:
    """A Ctrl-C reaches the worker directly and as its supervisor's SIGTERM."""
    supervisor.on_stop_signals(signals.loop, signals.stop, signals.hurry, supervised=True)
    await signals.send(signal.SIGINT, signal.SIGTERM)
    await signals.send(signal.SIGINT, signal.SIGTERM)
    assert signals.stop.is_set() and not signals.hurry.is_set()
