"""Load this process can see, measured continuously: event-loop lag and pool wait.

Admission by capacity: the dispatcher claims a turn only while both stayed within their bounds
over the last second, because a process whose loop lags cannot keep the leases of the turns it
already holds. Overload then shows as turns waiting in the queue, never as live turns reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

import asyncpg

from agentd.metrics import Metrics

log = logging.getLogger("agentd.load")

LOOP_SAMPLE_S = 0.05  # how often the loop's timer lateness is measured
POOL_PROBE_S = 0.1  # how often a pool connection is taken (and given back at once)
POOL_PROBE_TIMEOUT_S = 10.0
WINDOW_S = 1.0  # admission looks at the worst figure of this last stretch


class _Window:
    """The worst value seen in the last WINDOW_S seconds, and the worst since `take_peak`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque()
        self._peak = 0.0

    def add(self, value: float) -> None:
        now = self._clock()
        self._samples.append((now, value))
        self._peak = max(self._peak, value)
        while self._samples and self._samples[0][0] < now - WINDOW_S:
            self._samples.popleft()

    def worst(self) -> float:
        horizon = self._clock() - WINDOW_S
        return max((v for t, v in self._samples if t >= horizon), default=0.0)

    def take_peak(self) -> float:
        peak, self._peak = self._peak, 0.0
        return peak


class LoadMonitor:
    """Samples loop lag and pool wait into histograms, and decides admission from them."""

    def __init__(self, pool: asyncpg.Pool, metrics: Metrics, *, max_loop_lag_s: float,
                 max_pool_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._metrics = metrics
        self.max_loop_lag_s = max_loop_lag_s
        self.max_pool_wait_s = max_pool_wait_s
        self._clock = clock
        self._lag = _Window(clock)
        self._wait = _Window(clock)
        # When the pool probe still waiting for a connection began: a wait is known to be at
        # least this long before it ends (it may take POOL_PROBE_TIMEOUT_S), and admission must
        # not forget it once its last finished sample leaves the window.
        self._probing_since: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sampled = asyncio.Event()
        self.holding_back = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch_loop(), name="agentd-loop-lag"),
                       asyncio.create_task(self._probe_pool(), name="agentd-pool-wait")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def record_loop_lag(self, seconds: float) -> None:
        self._lag.add(seconds)
        self._metrics.loop_lag.observe(seconds)
        self._sampled.set()

    def record_pool_wait(self, seconds: float) -> None:
        self._wait.add(seconds)
        self._metrics.pool_wait.observe(seconds)
        self._sampled.set()

    def take_peaks(self) -> tuple[float, float]:
        """(worst loop lag, worst pool wait) in seconds since the previous call (for the beat)."""
        return self._lag.take_peak(), self._wait.take_peak()

    def overload(self) -> str | None:
        """Why this process should not take more work right now, or None."""
        lag, wait = self._lag.worst(), self._wait.worst()
        if self._probing_since is not None:
            wait = max(wait, self._clock() - self._probing_since)
        if lag > self.max_loop_lag_s:
            return (f"event loop lag {lag * 1000:.0f} ms > {self.max_loop_lag_s * 1000:.0f} ms "
                    "(max_loop_lag_ms)")
        if wait > self.max_pool_wait_s:
            return (f"pool wait {wait * 1000:.0f} ms > {self.max_pool_wait_s * 1000:.0f} ms "
                    "(max_pool_wait_ms)")
        return None

    async def admitted(self) -> None:
        """Return once this process may claim: at once when the load is within bounds, else
        after it recovers. Says so in the log once when it starts and once when it stops."""
        reason = self.overload()
        if reason is None:
            return
        self.holding_back = True
        self._metrics.holding_back.set(1)
        self._metrics.holds.inc()
        log.warning("holding back from claiming: this process is overloaded; turns wait in "
                    "the queue", extra={"reason": reason})
        started = time.monotonic()
        try:
            while self.overload() is not None:
                self._sampled.clear()
                await self._sampled.wait()  # a new sample may change the verdict
        finally:
            self.holding_back = False
            self._metrics.holding_back.set(0)
        log.warning("claiming again: the load is back within bounds",
                    extra={"held_back_s": round(time.monotonic() - started, 3)})

    async def _watch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(LOOP_SAMPLE_S)
            self.record_loop_lag(max(0.0, loop.time() - asked - LOOP_SAMPLE_S))

    async def _probe_pool(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(POOL_PROBE_S)
            asked = loop.time()
            self._probing_since = self._clock()
            try:
                async with self._pool.acquire(timeout=POOL_PROBE_TIMEOUT_S):
                    waited = loop.time() - asked
                    self._probing_since = None
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                # No connection within the probe's bound (or none at all): as bad as it gets.
                waited = loop.time() - asked
            finally:
                self._probing_since = None
            self.record_pool_wait(waited)
