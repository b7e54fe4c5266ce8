"""What every SSE stream of a device obeys: a slot under streams_per_device, and revocation.

A stream takes its slot before its first byte (over the limit: 429 with Retry-After) and gives
it back when it ends however it ends. While it runs, a revocation of its device cancels it and
sends one final `error` event (code `device_revoked`) before the stream closes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from types import TracebackType

from aiohttp import web

from agentd.accounts import Principal
from agentd.api import RUNTIME, sse
from agentd.api.auth import DEVICE_REVOKED
from agentd.revocation import Revoked
from agentd.vocabulary import STREAM_ERROR_EVENT


class DeviceStream:
    def __init__(self, request: web.Request, who: Principal) -> None:
        self._runtime = request.app[RUNTIME]
        self._device_id = who.device_id
        self._runtime.stream_slots.acquire(who.device_id)
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._runtime.stream_slots.release(self._device_id)

    def __enter__(self) -> DeviceStream:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    async def serve(self, response: web.StreamResponse, pump: Awaitable[None]) -> None:
        """Run `pump` (it writes the frames) to its end, the client's hang-up, or revocation."""
        watch = self._runtime.revocations
        with contextlib.suppress(ConnectionResetError):
            try:
                if watch is None:
                    await pump
                else:
                    await watch.run_unless_revoked(self._device_id, pump)
            except Revoked:
                await sse.send(response, None, STREAM_ERROR_EVENT, {
                    "type": STREAM_ERROR_EVENT, "error": {
                        "code": DEVICE_REVOKED,
                        "message": "this device's token was revoked; the stream ends here"}})


def open_device_stream(request: web.Request, who: Principal) -> DeviceStream:
    """Take a stream slot for `who`'s device (raises Throttled over streams_per_device)."""
    return DeviceStream(request, who)
