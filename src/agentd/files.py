"""Files written whole, with their mode from the first byte.

Secrets (tokens, keys, passwords, the client's config) and anything another local user must not
read go through `replace_file`: a new file is created with its final mode before a byte is
written, so it is never briefly readable whatever the umask, and then renamed over the old one,
so a reader sees the old file or the new one, never half of one, and an old file that was
readable is replaced rather than rewritten in place. Python's standard library has no such
call (`tempfile` makes the file but does not replace the target), hence these few lines.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from pathlib import Path

PRIVATE = 0o600
PRIVATE_DIR = 0o700
STALE_TEMPORARY_S = 600  # a temporary file this old was left by a writer that died
_TEMP_BYTES = 4  # random bytes in a temporary file's name


def replace_file(path: Path, data: str | bytes, *, mode: int = PRIVATE,
                 owner: tuple[int, int] | None = None, private_dirs: bool = False) -> None:
    """Replace `path` with `data` (text is UTF-8). `owner`: (uid, gid) to give it before it
    takes the place of the old file. `private_dirs`: first create its missing directories,
    each 0700 (make_private_dirs)."""
    if private_dirs:
        make_private_dirs(path.parent)
    _remove_stale_temporaries(path)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(_TEMP_BYTES)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)  # os.open's mode is narrowed by the umask: this is the one meant
        if owner is not None:
            os.chown(temporary, *owner)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    _sync_directory(path.parent)


def _remove_stale_temporaries(path: Path) -> None:
    """Remove what earlier writers of `path` killed mid-write (SIGKILL, a power loss) left: their
    temporary files, which may hold a secret. Only old ones: a young one may be another
    writer's, still under way."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{{2 * _TEMP_BYTES}}}")
    cutoff = time.time() - STALE_TEMPORARY_S
    with contextlib.suppress(OSError):  # a directory that cannot be listed: nothing to tidy
        for entry in os.scandir(path.parent):
            if pattern.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)


def _sync_directory(directory: Path) -> None:
    """Make the rename itself durable: after a power loss the new file is there, not the old."""
    with contextlib.suppress(OSError):  # a filesystem that cannot sync a directory: as before
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_private_dirs(directory: Path) -> None:
    """Create `directory` and each missing parent with mode 0700 (mkdir's `parents` gives the
    parents the umask's mode); directories that exist are left as they are."""
    missing: list[Path] = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for created in reversed(missing):
        try:
            created.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs to set
        os.chmod(created, PRIVATE_DIR)  # mkdir's mode is narrowed by the umask too
