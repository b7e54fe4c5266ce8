"""Every file agenttui reads or writes, in one place (platformdirs' user config/cache/state dirs).

AGENTTUI_CONFIG_DIR, AGENTTUI_CACHE_DIR and AGENTTUI_STATE_DIR override the defaults. The config
file's reader and writer live in agentd.client_config, since agentd writes that file too.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from agentd.client_config import (
    APP,
    config_dir,
    config_file,
    read_config,
    write_client_config,
)

__all__ = ["cache_dir", "clipboard_file", "config_dir", "config_file", "drafts_state_file",
           "read_config", "state_dir", "write_client_config"]


def cache_dir() -> Path:
    override = os.environ.get("AGENTTUI_CACHE_DIR")
    return Path(override) if override else platformdirs.user_cache_path(APP)


def state_dir() -> Path:
    override = os.environ.get("AGENTTUI_STATE_DIR")
    return Path(override) if override else platformdirs.user_state_path(APP)


def clipboard_file() -> Path:
    """Where a copy also lands, for terminals that ignore OSC 52 clipboard requests."""
    return cache_dir() / "clipboard.txt"


def drafts_state_file() -> Path:
    """Ids of drafts already handed back to this device's composer (offered once, not again)."""
    return state_dir() / "drafts.json"
