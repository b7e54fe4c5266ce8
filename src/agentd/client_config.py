"""The client's config file, which agentd writes too: on its first embedded start it hands the
local agenttui a token, as `agenttui login` does for a remote daemon.

agenttui reads and writes it through these functions; agentd never imports agenttui.
AGENTTUI_CONFIG_DIR overrides the directory (platformdirs' user config dir of "agenttui").
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import platformdirs

APP = "agenttui"


def config_dir() -> Path:
    override = os.environ.get("AGENTTUI_CONFIG_DIR")
    return Path(override) if override else platformdirs.user_config_path(APP)


def config_file() -> Path:
    return config_dir() / "config.toml"


def read_config() -> dict[str, object]:
    path = config_file()
    if not path.exists():
        return {}
    return tomllib.loads(path.read_text("utf-8"))


def write_client_config(url: str, token: str, *, device: str | None = None,
                        fingerprint: str | None = None) -> Path:
    """Store URL, token and pinned fingerprint with mode 0600 (never briefly world-readable)."""
    path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    existing = {k: v for k, v in read_config().items()
                if k not in ("url", "token", "device", "fingerprint")}
    lines = [f"url = {_toml_string(url)}", f"token = {_toml_string(token)}"]
    if device:
        lines.append(f"device = {_toml_string(device)}")
    if fingerprint:
        lines.append(f"fingerprint = {_toml_string(fingerprint)}")
    # Keep the user's other settings, tables ([keys], [params]) included.
    tables = {k: v for k, v in existing.items() if isinstance(v, dict)}
    for key, value in existing.items():
        if key not in tables and _toml_value(value) is not None:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for name, table in tables.items():
        lines += ["", f"[{_toml_key(name)}]"]
        for key, value in table.items():
            if _toml_value(value) is not None:
                lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def _toml_string(value: str) -> str:
    # A JSON string is a TOML basic string, once DEL (which TOML wants escaped) is escaped too.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "-_") for c in key)
    return key if bare else _toml_string(key)


def _toml_value(value: object) -> str | None:
    """Scalars and lists of scalars; anything else is not ours to rewrite (None)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        items = [_toml_value(v) for v in value]
        if any(item is None for item in items):
            return None
        return "[" + ", ".join(str(item) for item in items) + "]"
    return None
