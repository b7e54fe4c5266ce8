"""A real program under a pseudo-terminal, read through a screen model: what a user would see.

`Terminal` spawns a command on a fresh pty (ptyprocess). A reader thread drains the pty for as
long as the program runs, so the program never blocks on a full pty buffer, and feeds every
byte to a pyte screen and to `output` (the raw stream, for escape sequences). Waits re-check the
screen each time output arrives, against a deadline: nothing sleeps for a state.

Keys go in as a terminal sends them: `write_raw` is one write (a burst: what a paste without
bracketed paste, a laggy link or `tmux send-keys` delivers), `type` sends one key per read (it
waits until the program has read each key before sending the next), `paste` wraps text in
bracketed-paste markers with newlines as CR, as terminals send them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import signal
import struct
import termios
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import ptyprocess
import pyte

from tests.support.daemon import poll_until

T = TypeVar("T")

WAIT_S = 60.0  # generous: other suites share the machine's cores
READ_CHUNK = 65536
PASTE_START, PASTE_END = b"\x1b[200~", b"\x1b[201~"

# What a terminal sends for a key (xterm, no modifiers encoding beyond the classic control keys).
KEYS = {
    "enter": b"\r", "tab": b"\t", "escape": b"\x1b", "backspace": b"\x7f",
    "up": b"\x1b[A", "down": b"\x1b[B", "right": b"\x1b[C", "left": b"\x1b[D",
    "home": b"\x1b[H", "end": b"\x1b[F", "f1": b"\x1bOP", "f2": b"\x1bOQ",
    **{f"ctrl+{c}": bytes([ord(c) - ord("a") + 1]) for c in "abcdefghijklmnopqrstuvwxyz"},
}

# The environment a terminal test controls: never the machine's terminal, locale or settings.
BASE_ENV = {"TERM": "xterm-256color", "COLORTERM": "truecolor", "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "PYTHONUTF8": "1", "PYTHONUNBUFFERED": "1"}
_DROPPED_ENV = ("AGENTD_", "AGENTTUI_", "TEXTUAL", "LC_", "NO_COLOR", "FORCE_COLOR", "COLUMNS",
                "LINES", "TMUX", "STY")


def terminal_env(**extra: str) -> dict[str, str]:
    """This process's environment without terminal, locale or agent settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_DROPPED_ENV) and k not in ("LANG", "LANGUAGE")}
    return {**env, **BASE_ENV, **extra}


class Terminal:
    """One program on its own pty, `size` = (columns, rows)."""

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str],
                 cwd: Path | str | None = None, size: tuple[int, int] = (100, 30),
                 record_screens: bool = False) -> None:
        """`record_screens`: keep the screen as it stood after each read of the program's
        output (`screens`), to check what a reader could have seen between two waits."""
        columns, rows = size
        self._screens: list[str] | None = [] if record_screens else None
        self.argv = list(argv)
        self.screen = pyte.Screen(columns, rows)
        self._stream = pyte.ByteStream(self.screen)
        self._output = bytearray()
        self._changed = threading.Condition()
        self._eof = False
        # A fresh pty's settings: what the program found, and must leave, on its terminal.
        self.initial_termios = _fresh_pty_termios()
        self.proc = ptyprocess.PtyProcess.spawn(self.argv, env=dict(env), cwd=cwd,
                                                dimensions=(rows, columns))
        # Our own handle on the program's side of the pty, to see whether it has read its input
        # (Linux: the pty's name from /proc).
        try:
            self._slave: int | None = os.open(os.readlink(f"/proc/{self.proc.pid}/fd/0"),
                                              os.O_RDWR | os.O_NOCTTY)
        except OSError:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise
        self._reader = threading.Thread(target=self._drain, name=f"pty-{self.proc.pid}",
                                        daemon=True)
        self._reader.start()

    # -- input ---------------------------------------------------------------------------------

    def write_raw(self, data: bytes | str) -> None:
        """Everything in one write, as one read of the program's terminal would get it."""
        data = data.encode() if isinstance(data, str) else data
        written = os.write(self.proc.fd, data)
        while written < len(data):  # more than the pty buffers: the rest as the program reads
            written += os.write(self.proc.fd, data[written:])

    def press(self, *keys: str) -> None:
        """Named keys (`enter`, `escape`, `ctrl+q`, ...), each in its own write."""
        for key in keys:
            self.write_raw(KEYS[key])

    async def type(self, text: str, *, timeout: float = WAIT_S) -> None:  # noqa: ASYNC109
        """One key at a time: each character is read by the program before the next is sent."""
        for char in text:
            self.write_raw(char)
            await poll_until(self._input_read, timeout, interval=0.002,
                             what=f"the program to read {char!r}")

    def paste(self, text: str) -> None:
        """A bracketed paste, newlines sent as CR as terminals do, in one write."""
        body = text.replace("\r\n", "\n").replace("\n", "\r").encode()
        self.write_raw(PASTE_START + body + PASTE_END)

    def resize(self, columns: int, rows: int) -> None:
        """The window changes size: the program gets SIGWINCH; the screen model follows."""
        with self._changed:
            self.screen.resize(rows, columns)
        self.proc.setwinsize(rows, columns)

    async def _input_read(self) -> bool:
        if self._slave is None:
            return True
        pending = fcntl.ioctl(self._slave, termios.FIONREAD, struct.pack("i", 0))
        return struct.unpack("i", pending)[0] == 0

    # -- output --------------------------------------------------------------------------------

    def screen_text(self) -> str:
        """The screen as lines of text (trailing blanks removed)."""
        with self._changed:
            return self._text()

    def _text(self) -> str:
        return "\n".join(line.rstrip() for line in self.screen.display)

    @property
    def screens(self) -> list[str]:
        """Every screen recorded so far, oldest first (record_screens)."""
        with self._changed:
            assert self._screens is not None, "opened without record_screens"
            return list(self._screens)

    @property
    def output(self) -> bytes:
        """Every byte the program wrote to its terminal so far."""
        with self._changed:
            return bytes(self._output)

    @property
    def cursor_hidden(self) -> bool:
        with self._changed:
            return bool(self.screen.cursor.hidden)

    def termios(self) -> list:
        """The terminal's settings now (the pty's, whoever set them)."""
        return termios.tcgetattr(self.proc.fd)

    async def wait_for_text(self, pattern: str | re.Pattern[str],
                            timeout: float = WAIT_S) -> str:  # noqa: ASYNC109
        """Until the screen shows `pattern` (a literal string or a compiled regex); returns
        the matched text."""
        regex = pattern if isinstance(pattern, re.Pattern) else re.compile(re.escape(pattern))

        def shown(text: str) -> str | None:
            found = regex.search(text)
            return found.group(0) if found else None

        return await self.wait_for(shown, timeout, what=f"{regex.pattern!r} on the screen")

    async def wait_for(self, predicate: Callable[[str], T | None],
                       timeout: float = WAIT_S,  # noqa: ASYNC109
                       *, what: str = "the screen") -> T:
        """Until `predicate(screen_text)` is truthy; returns its value. Re-checked whenever
        output arrives; at the deadline the failure shows the screen."""
        return await asyncio.to_thread(self._wait, predicate, timeout, what)

    def _wait(self, predicate: Callable[[str], T | None], timeout: float, what: str) -> T:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                value = predicate(self._text())
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    state = "the program exited" if self._eof else f"after {timeout:g}s"
                    raise AssertionError(f"timed out ({state}) waiting for {what}; the screen:"
                                         f"\n{self._text()}")
                self._changed.wait(left)

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.proc.fd, READ_CHUNK)
            except OSError:  # EIO: nothing holds the program's side any more
                data = b""
            with self._changed:
                if not data:
                    self._eof = True
                    self._changed.notify_all()
                    return
                self._output += data
                self._stream.feed(data)
                if self._screens is not None:
                    self._screens.append(self._text())
                self._changed.notify_all()

    # -- the program ---------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.isalive()

    async def wait_exit(self, timeout: float = WAIT_S) -> int:  # noqa: ASYNC109
        """The exit code, once the program ended and all its output was read."""

        async def ended() -> bool:
            return not self.proc.isalive()

        await poll_until(ended, timeout, interval=0.02, what=f"{self.argv[0]} to exit")
        self._release_slave()
        await asyncio.to_thread(self._reader.join, timeout)
        assert not self._reader.is_alive(), "the pty reader did not finish"
        status = self.proc.exitstatus
        return -(self.proc.signalstatus or 0) if status is None else status

    def _release_slave(self) -> None:
        if self._slave is not None:
            os.close(self._slave)
            self._slave = None

    def close(self) -> None:
        """Kill the program if it still runs, and free the pty. Idempotent."""
        if self.proc.isalive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                self.proc.wait()
        self._release_slave()
        self._reader.join(10)
        if not self.proc.closed:
            self.proc.fileobj.close()
            self.proc.closed = True


def _fresh_pty_termios() -> list:
    master, slave = os.openpty()
    try:
        return termios.tcgetattr(slave)
    finally:
        os.close(master)
        os.close(slave)
