"""Which handed-back drafts this device has already put in its composer (offered once only).

A stopped queued turn stays a `draft` message on the server forever; without this ledger every
restart would push the same old text back into the composer.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from agenttui.locations import drafts_state_file

KEEP = 500


class DraftLedger:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or drafts_state_file()
        self._ids: list[str] = []
        with contextlib.suppress(OSError, ValueError, TypeError):
            data = json.loads(self.path.read_text("utf-8"))
            self._ids = [str(i) for i in data.get("consumed", [])][-KEEP:]
        self._set = set(self._ids)

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._set

    def consume(self, message_ids: Iterable[str]) -> None:
        new = [i for i in message_ids if i not in self._set]
        if not new:
            return
        self._ids = (self._ids + new)[-KEEP:]
        self._set = set(self._ids)
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"consumed": self._ids}), "utf-8")
            os.replace(tmp, self.path)
