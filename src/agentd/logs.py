"""Structured log lines on stderr: time, level, logger, message, then key=value pairs.

Pass context with `extra={"run_id": ...}`; journald and grep both read it without a parser.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def __init__(self, fixed: dict[str, str] | None = None) -> None:
        super().__init__()
        self._fixed = fixed or {}  # on every line (a supervised worker's slot)

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [f"{stamp}.{int(record.msecs):03d}Z", record.levelname.lower(), record.name,
                 json.dumps(record.getMessage(), ensure_ascii=False)]
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                text = value if isinstance(value, (int, float)) else str(value)
                if isinstance(text, str) and (not text or any(c in text for c in ' "=')):
                    text = json.dumps(text, ensure_ascii=False)
                parts.append(f"{key}={text}")
        parts += [f"{key}={value}" for key, value in self._fixed.items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(level: str = "info", *, worker: str | None = None) -> None:
    """`worker`: this process is worker N of `agentd serve --workers` (every line says so)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter({"worker": worker} if worker else None))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
