"""Reading `postmaster.pid` and telling a live server of ours from a stale file: a stale one is
removed, never reused."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agentd.embedded_pg.errors import EmbeddedPgError


@dataclass(frozen=True)
class PidFile:
    """The parts of ``postmaster.pid`` we rely on (see PostgreSQL's miscadmin.h)."""

    pid: int
    data_dir: str
    port: int | None
    socket_dir: str
    status: str
    started: str = ""  # the postmaster's start time (epoch seconds): with the pid, one server

    @property
    def identity(self) -> str:
        """This server and no other: a pid a later server could reuse, and its start time."""
        return f"{self.pid} {self.started}"


def read_pid_file(path: Path) -> PidFile | None:
    """Parse ``postmaster.pid`` (or a socket lock file); None if missing or garbled."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError as exc:
        raise EmbeddedPgError(f"cannot read {path}: {exc}") from exc
    try:
        pid = int(lines[0].strip())
    except (IndexError, ValueError):
        return None

    def at(n: int) -> str:
        return lines[n].strip() if len(lines) > n else ""
    port = int(at(3)) if at(3).isdigit() else None
    return PidFile(pid=pid, data_dir=at(1), port=port, socket_dir=at(4), status=at(7),
                   started=at(2))


def is_our_postgres(pid: int, data_dir: Path) -> bool:
    """Return whether ``pid`` is a live PostgreSQL process working in ``data_dir``.

    Its working directory is the proof; where it cannot be read (root without CAP_SYS_PTRACE,
    a container's default, cannot read another account's), its command line's `-D` is. A server
    that cannot be disproved is taken as live: deleting a live server's pid file lets a second
    one start on its data directory."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # Another account's process (we are not root), while our server runs as us.
        return False
    proc = Path(f"/proc/{pid}")
    if proc.is_dir():
        try:
            if (proc / "comm").read_text().strip() != "postgres":
                return False
        except OSError:
            return False  # gone meanwhile
        try:
            # The postmaster chdirs into its data directory.
            return os.path.realpath(os.readlink(proc / "cwd")) == os.path.realpath(data_dir)
        except PermissionError:
            return _launched_on(proc, data_dir)
        except OSError:
            return False  # gone meanwhile, or a zombie
    # No /proc (macOS, BSD): the process name is the best cheap evidence available.
    try:
        out = subprocess.run(
            ["ps", "-p", str(pid), "-o", "comm="], capture_output=True, text=True, timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return True
    return Path(out.stdout.strip()).name == "postgres"


def _launched_on(proc: Path, data_dir: Path) -> bool:
    """Whether the postmaster's command line names `data_dir` (pg_ctl starts it with `-D`);
    a command line that cannot be read, or names none, does not disprove it."""
    try:
        args = (proc / "cmdline").read_bytes().split(b"\0")
    except PermissionError:
        return True
    except OSError:
        return False  # gone meanwhile
    for flag, value in itertools.pairwise(args):
        if flag == b"-D":
            return os.path.realpath(os.fsdecode(value)) == os.path.realpath(data_dir)
    return True


def processes_in(data_dir: Path) -> bool:
    """Return whether any process we can see has ``data_dir`` as its working directory (a
    PostgreSQL process whose directory cannot be read counts, unless its command line names
    another data directory: in doubt, the caller waits)."""
    target = os.path.realpath(data_dir)
    try:
        entries = os.listdir("/proc")
    except FileNotFoundError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        proc = Path(f"/proc/{entry}")
        try:
            if os.path.realpath(os.readlink(proc / "cwd")) == target:
                return True
        except PermissionError:
            with contextlib.suppress(OSError):
                if (proc / "comm").read_text().strip() == "postgres" and \
                        _launched_on(proc, data_dir):
                    return True
        except OSError:
            continue
    return False
