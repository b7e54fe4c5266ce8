"""agenttui's settings as one typed object: defaults < config file < AGENTTUI_* env < flags.

The config file is the one agentd writes on its first embedded start (url, token, device), so a
TUI on the same machine needs no setup; `agenttui login` writes it for remote daemons.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import httpx

from agentd.settings import literal_loopback
from agenttui.client import DEFAULT_URL, token_problem, url_problem
from agenttui.locations import read_config

DEFAULT_THEME = "agenttui"
ENV_PREFIX = "AGENTTUI_"


class SettingsError(ValueError):
    """A setting has a value of the wrong kind; the message names it and where it came from."""


@dataclass(frozen=True)
class Settings:
    url: str = DEFAULT_URL
    token: str | None = None
    device: str | None = None  # the name this device's token was minted for (informational)
    fingerprint: str | None = None  # the pinned certificate of an https:// daemon (login)
    conversation: str | None = None  # open this conversation at start
    theme: str = DEFAULT_THEME
    model: str | None = None  # model for new turns (`provider:model`); the daemon's default
    params: dict[str, Any] = field(default_factory=dict)  # provider params for new turns
    keys: dict[str, str] = field(default_factory=dict)  # binding id -> keys, e.g. stop = "f8"
    export_dir: Path | None = None  # where exports go (default: the working directory)
    timeout_s: float = 15.0  # one API call
    stream_timeout_s: float = 45.0  # silence (no keepalive) before a stream counts as dead

    def with_flags(self, **flags: Any) -> Settings:
        """Command-line values win; None means "not given"."""
        return replace(self, **{k: v for k, v in flags.items() if v is not None})


_STRINGS = ("url", "token", "device", "fingerprint", "conversation", "theme", "model")
_FLOATS = ("timeout_s", "stream_timeout_s")


def load_settings(*, config: Mapping[str, Any] | None = None,
                  env: Mapping[str, str] | None = None, **flags: Any) -> Settings:
    """Resolve settings; raises SettingsError naming the offending key."""
    config = read_config() if config is None else config
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name, value in config.items():
        values.update(_coerce(name, value, "the config file"))
    for name in (f.name for f in fields(Settings)):
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            values.update(_coerce(name, raw, f"${ENV_PREFIX}{name.upper()}"))
    settings = Settings(**values).with_flags(**flags)
    settings = _credentials_for_their_daemon(settings, config, env)
    problem = url_problem(settings.url)
    if problem is None and settings.token is not None:
        problem = token_problem(settings.token)
    if problem is not None:
        raise SettingsError(problem)
    return settings


def _credentials_for_their_daemon(settings: Settings, config: Mapping[str, Any],
                                  env: Mapping[str, str]) -> Settings:
    """The config file's token and pin belong to the daemon it names (`login` stored them
    together): another URL given in the environment or on the command line does not get them,
    or an `http://` URL would carry that daemon's token in clear text to whoever answers it.
    A token from $AGENTTUI_TOKEN is the user's choice for whatever URL is in use."""
    stored = config.get("url", DEFAULT_URL)  # a config without one is the default's
    if not isinstance(stored, str) or same_daemon(stored, settings.url):
        return settings
    from_env = {name: bool(env.get(ENV_PREFIX + name.upper())) for name in
                ("token", "fingerprint", "device")}
    dropped: dict[str, Any] = {name: None for name, given in from_env.items() if not given
                               and config.get(name) == getattr(settings, name)}
    return replace(settings, **dropped)


def same_daemon(one: str, other: str) -> bool:
    """Whether two URLs reach one daemon: the same scheme, host and port once spelled alike
    (case, a default port, a trailing slash); loopback names (localhost, 127.0.0.1, ::1) are one
    host, since what they carry never leaves the machine."""
    try:
        a, b = httpx.URL(one), httpx.URL(other)
    except (httpx.InvalidURL, TypeError, ValueError):
        return False  # not a URL: its own check says so
    return (a.scheme, a.port) == (b.scheme, b.port) and (
        a.host == b.host or (literal_loopback(a.host) and literal_loopback(b.host)))


def _coerce(name: str, value: Any, source: str) -> dict[str, Any]:
    if name in _STRINGS:
        if not isinstance(value, str):
            raise SettingsError(f"{name} in {source} must be a string")
        return {name: value.rstrip("/") if name == "url" else value}
    if name in _FLOATS:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{name} in {source} must be a number") from None
        if number <= 0:
            raise SettingsError(f"{name} in {source} must be positive")
        return {name: number}
    if name == "export_dir":
        if not isinstance(value, str):
            raise SettingsError(f"export_dir in {source} must be a path")
        return {name: Path(value).expanduser()}
    if name == "keys":
        return {name: _keys(value, source)}
    if name == "params":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise SettingsError(f"params in {source} must be a JSON object") from None
        if not isinstance(value, Mapping):
            raise SettingsError(f"params in {source} must be a table / JSON object")
        return {name: dict(value)}
    return {}  # unknown keys belong to someone else (or a newer version): ignored


def _keys(value: Any, source: str) -> dict[str, str]:
    """`[keys]` table, or in the environment `stop=f8;send=enter`."""
    if isinstance(value, str):
        pairs = [item.split("=", 1) for item in value.replace(";", "\n").splitlines()
                 if item.strip()]
        if any(len(pair) != 2 for pair in pairs):
            raise SettingsError(f"keys in {source} must look like 'stop=f8;send=enter'")
        value = {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in value.items()):
        raise SettingsError(f"keys in {source} must map binding ids to key names")
    return {k: v.replace(" ", "") for k, v in value.items()}


def export_directory(settings: Settings) -> Path:
    return settings.export_dir or Path(os.getcwd())
