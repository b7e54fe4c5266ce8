"""Which handed-back drafts this device has already put in its composer (offered once only).

A stopped queued turn stays a `draft` message on the server forever; without this ledger every
restart would push the same old text back into the composer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterable
from pathlib import Path

from agentd.files import replace_file
from agenttui.locations import drafts_state_file

KEEP = 500


class DraftLedger:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or drafts_state_file()
        self._ids = _read(self.path)
        self._set = set(self._ids)

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._set

    def consume(self, message_ids: Iterable[str]) -> None:
        new = [i for i in message_ids if i not in self._set]
        if not new:
            return
        self._ids = (self._ids + new)[-KEEP:]
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # Two agenttui on one machine share the file: each adds its own to what is there
            # now, in turn, instead of writing back the list it read at its start.
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                on_disk = _read(self.path)
                mine = set(on_disk)
                merged = on_disk + [i for i in self._ids if i not in mine]
                self._ids = merged[-KEEP:]
                replace_file(self.path, json.dumps({"consumed": self._ids}))
        self._set = set(self._ids)


def _read(path: Path) -> list[str]:
    """The ids kept in `path`, oldest first; none when it is missing or unreadable."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        data = json.loads(path.read_text("utf-8"))
        return [str(i) for i in data.get("consumed", [])][-KEEP:]
    return []
