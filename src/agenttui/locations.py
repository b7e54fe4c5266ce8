"""Every file agenttui reads or writes, in one place (platformdirs' user config dir)."""

from __future__ import annotations

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


def write_client_config(url: str, token: str, *, device: str | None = None) -> Path:
    """Store URL and token with mode 0600 (created that way: never briefly world-readable)."""
    path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    existing = {k: v for k, v in read_config().items() if k not in ("url", "token", "device")}
    lines = [f"url = {_toml_string(url)}", f"token = {_toml_string(token)}"]
    if device:
        lines.append(f"device = {_toml_string(device)}")
    for key, value in existing.items():
        if isinstance(value, str):
            lines.append(f"{key} = {_toml_string(value)}")
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def _toml_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
