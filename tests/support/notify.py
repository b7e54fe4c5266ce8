"""A stand-in for systemd's notification socket: what a daemon started with NOTIFY_SOCKET tells
its service manager (READY=1, STATUS=…, STOPPING=1, EXTEND_TIMEOUT_USEC=…), in order."""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.support.daemon import poll_until


class NotifySocket:
    """A datagram socket a daemon reports to; `messages` holds every datagram so far."""

    def __init__(self) -> None:
        # A socket path is limited to ~107 bytes: a short private directory, not the test's.
        self._dir = Path(tempfile.mkdtemp(prefix="sdn-"))
        self.path = self._dir / "notify"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self.path))
        self._sock.setblocking(False)
        self.messages: list[str] = []

    @property
    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": str(self.path)}

    def received(self) -> list[str]:
        with contextlib.suppress(BlockingIOError):
            while True:
                self.messages.append(self._sock.recv(4096).decode())
        return self.messages

    def fields(self) -> list[dict[str, str]]:
        """Each message as its KEY=value lines."""
        return [dict(line.split("=", 1) for line in message.splitlines() if "=" in line)
                for message in self.received()]

    async def wait_for(self, key: str, timeout: float) -> dict[str, str]:  # noqa: ASYNC109
        """The first message that sets `key` (waiting for it)."""
        def find() -> dict[str, str] | None:
            return next((f for f in self.fields() if key in f), None)

        return await poll_until(find, timeout, what=f"{key} on the notification socket")

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def notify_socket() -> Iterator[NotifySocket]:
    sock = NotifySocket()
    try:
        yield sock
    finally:
        sock.close()
