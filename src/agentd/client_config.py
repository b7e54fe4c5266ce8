"""The client's config file, which agentd writes too: on its first embedded start it hands the
local agenttui a token, as `agenttui login` does for a remote daemon.

agenttui reads and writes it through these functions; agentd never imports agenttui.
AGENTTUI_CONFIG_DIR overrides the directory (platformdirs' user config dir of "agenttui").
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import platformdirs
import tomli_w

from agentd.files import replace_file

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
    """Store URL, token and pinned fingerprint with mode 0600 (never briefly world-readable),
    keeping the user's other settings, tables ([keys], [params]) included."""
    path = config_file()
    config: dict[str, Any] = {"url": url, "token": token}
    if device:
        config["device"] = device
    if fingerprint:
        config["fingerprint"] = fingerprint
    for key, value in read_config().items():
        if key not in ("url", "token", "device", "fingerprint"):
            config[key] = value
    replace_file(path, tomli_w.dumps(config), private_dirs=True)
    return path
