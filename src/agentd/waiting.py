"""Waiting for some work unless an event comes first: a worker's exit or a restart's pause
against the stop, a drain against a second Ctrl-C that cuts it short, a request against its
device's revocation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def ended_first(work: Awaitable[Any], event: asyncio.Event) -> bool:
    """Await `work` unless `event` is set first; then cancel what is left of it (shield work
    that must go on) and wait until it has ended. True when the work ended first; its outcome
    is left in `work` when that is a task."""
    task = asyncio.ensure_future(work)
    setting = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, setting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        setting.cancel()
        if not task.done():
            task.cancel()
            # Waited for, not awaited: its CancelledError stays in it, and this caller's own
            # cancellation still reaches the caller.
            await asyncio.wait({task})
    return not task.cancelled() and not event.is_set()
