"""Revocation that bites live streams: a revoked device's open streams (and long waits on a
run) end within a keepalive.

One watcher per process keeps the devices that hold streams here. It re-reads their state on the
`agentd_device` hint that revoke_device sends (so a revocation usually lands in milliseconds),
and polls anyway every half keepalive interval, so a lost hint (hub down, a revocation written
by hand) is caught within one keepalive interval all the same. Rows are truth; hints only hurry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterator
from typing import TypeVar
from uuid import UUID

import asyncpg

from agentd.accounts import revoked_devices_among
from agentd.db import DB_ERRORS
from agentd.hub import Hub
from agentd.vocabulary import Channel
from agentd.waiting import ended_first

log = logging.getLogger("agentd.revocation")

T = TypeVar("T")


class Revoked(Exception):
    """The device behind this stream was revoked while it was open."""


class RevocationWatch:
    def __init__(self, pool: asyncpg.Pool, hub: Hub, *, poll_s: float) -> None:
        self._pool = pool
        self._hub = hub
        self._poll_s = poll_s
        self._watched: dict[UUID, tuple[asyncio.Event, int]] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="agentd-revocation")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.contextmanager
    def watch(self, device_id: UUID) -> Iterator[asyncio.Event]:
        """An event set once `device_id` is revoked, for as long as the block runs."""
        event, count = self._watched.get(device_id, (asyncio.Event(), 0))
        self._watched[device_id] = (event, count + 1)
        if count == 0:
            self._changed.set()  # a new device: look at it now, not at the next poll
        try:
            yield event
        finally:
            event, count = self._watched[device_id]
            if count <= 1:
                del self._watched[device_id]
            else:
                self._watched[device_id] = (event, count - 1)

    async def run_unless_revoked(self, device_id: UUID, work: Awaitable[T]) -> T:
        """Await `work`; if the device is revoked first, cancel it and raise Revoked."""
        with self.watch(device_id) as revoked:
            task = asyncio.ensure_future(work)
            if revoked.is_set():
                task.cancel()  # revoked already: the work never starts
            await ended_first(task, revoked)
            if revoked.is_set() and task.cancelled():
                raise Revoked()
            return task.result()

    async def _run(self) -> None:
        async with self._hub.subscribe(Channel.DEVICE) as sub:
            while True:
                self._changed.clear()
                sub.clear()
                if self._watched:
                    try:
                        await self._check()
                    except DB_ERRORS as exc:
                        log.warning("revocation check failed; will retry",
                                    extra={"error": str(exc)})
                hinted = asyncio.create_task(sub.wait(self._poll_s))
                added = asyncio.create_task(self._changed.wait())
                try:
                    await asyncio.wait({hinted, added}, timeout=self._poll_s,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    hinted.cancel()
                    added.cancel()

    async def _check(self) -> None:
        ids = list(self._watched)
        for device_id in await revoked_devices_among(self._pool, ids):
            entry = self._watched.get(device_id)
            if entry is not None and not entry[0].is_set():
                log.info("device revoked: ending its streams", extra={"device_id": str(device_id)})
                entry[0].set()
