"""One typed settings object: defaults, then the config file, then AGENTD_* variables, then flags.

Every setting has all four spellings; an invalid value fails at start with the key's name.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

ENV_PREFIX = "AGENTD_"
MAX_MODEL_NAME = 200  # `<provider>:<model>`, as the API accepts it and a conversation stores it


class SettingsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    """One `[providers.<name>]` table: how to reach a model provider."""

    name: str
    kind: str  # demo | openai | anthropic | local
    base_url: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 60.0
    model_path: str | None = None
    # The models it offers (GET /v1/models, and what enqueue accepts): `<name>:<model>` for each.
    # Empty for a `local` provider with a model_path: it offers that file, named by its stem.
    models: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Settings:
    dsn: str | None = None  # None: run the embedded PostgreSQL
    hub_dsn: str | None = None  # LISTEN must bypass transaction poolers; defaults to dsn
    listen: str = "127.0.0.1:8740"
    data_dir: Path | None = None  # embedded PostgreSQL's root; None: the platform default
    pg_user: str | None = None  # account the embedded server runs as when agentd is root
    lease_ttl_s: float = 30.0
    heartbeat_s: float = 10.0
    reap_interval_s: float = 5.0
    reap_grace_s: float = 5.0
    tick_s: float = 10.0
    max_runs: int = 16
    drain_s: float = 25.0
    flush_ms: int = 250
    pool_max: int = 20
    journal_retention_s: float = 86_400.0
    keepalive_s: float = 15.0
    default_model: str = "demo"
    max_tool_steps: int = 8
    max_content_chars: int = 100_000
    log_level: str = "info"
    providers: Mapping[str, ProviderConfig] = field(default_factory=dict)

    def validate(self) -> Settings:
        positive = ("lease_ttl_s", "heartbeat_s", "reap_interval_s", "tick_s", "flush_ms",
                    "keepalive_s")
        for key in positive:
            if getattr(self, key) <= 0:
                raise SettingsError(f"{key} ({_env(key)}) must be > 0")
        for key in ("max_runs", "pool_max", "max_tool_steps", "max_content_chars"):
            if getattr(self, key) < 1:
                raise SettingsError(f"{key} ({_env(key)}) must be >= 1")
        for key in ("drain_s", "reap_grace_s", "journal_retention_s"):
            if getattr(self, key) < 0:
                raise SettingsError(f"{key} ({_env(key)}) must be >= 0")
        if self.heartbeat_s > self.lease_ttl_s / 3:
            raise SettingsError(
                f"heartbeat_s ({self.heartbeat_s}) must be at most lease_ttl_s/3 "
                f"({self.lease_ttl_s / 3:g}) so a lease survives two missed beats")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SettingsError(f"listen ({_env('listen')}) must be HOST:PORT, got "
                                f"{self.listen!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise SettingsError("log_level (AGENTD_LOG_LEVEL) must be debug|info|warning|error")
        for provider in self.providers.values():
            if provider.kind not in ("demo", "openai", "anthropic", "local"):
                raise SettingsError(f"providers.{provider.name}.kind must be demo, openai, "
                                    f"anthropic or local, got {provider.kind!r}")
        return self

    @property
    def listen_host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def listen_port(self) -> int:
        return int(self.listen.rpartition(":")[2])


def _env(key: str) -> str:
    return ENV_PREFIX + key.upper()


def default_config_path() -> Path:
    return platformdirs.user_config_path("agentd") / "config.toml"


_SCALARS = {f.name: f for f in dataclasses.fields(Settings) if f.name != "providers"}


def _coerce(key: str, value: Any, source: str) -> Any:
    kind = _SCALARS[key].type
    try:
        if value is None:
            return None
        if "Path" in kind:
            return Path(os.path.expanduser(str(value)))
        if kind.startswith("float"):
            return float(value)
        if kind.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if isinstance(value, (dict, list)):
            raise ValueError(value)
        text = str(value)
        return None if ("None" in kind and text == "") else text
    except (TypeError, ValueError):
        raise SettingsError(f"{key} (from {source}): {value!r} is not a valid "
                            f"{kind.split(' |')[0]}") from None


def _default_providers() -> dict[str, ProviderConfig]:
    return {
        "demo": ProviderConfig("demo", "demo", models=("demo",)),
        "openai": ProviderConfig("openai", "openai", base_url="https://api.openai.com/v1",
                                 api_key_env="OPENAI_API_KEY",
                                 models=("gpt-4.1", "gpt-4.1-mini", "gpt-4o", "gpt-4o-mini")),
        "anthropic": ProviderConfig("anthropic", "anthropic",
                                    base_url="https://api.anthropic.com",
                                    api_key_env="ANTHROPIC_API_KEY",
                                    models=("claude-sonnet-4-0", "claude-opus-4-1",
                                            "claude-3-5-haiku-latest")),
        "local": ProviderConfig("local", "local"),
    }


def _model_list(name: str, value: Any, source: str) -> tuple[str, ...]:
    """`models` as a TOML array, or in the environment a comma-separated list."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(m, str) for m in items):
        raise SettingsError(f"providers.{name}.models (from {source}) must be a list of "
                            f"model names")
    models = tuple(m.strip() for m in items if m.strip())
    for model in models:
        if len(f"{name}:{model}") > MAX_MODEL_NAME or any(c.isspace() for c in model):
            raise SettingsError(f"providers.{name}.models (from {source}): {model!r} is not a "
                                f"model name (no spaces; `{name}:<model>` at most "
                                f"{MAX_MODEL_NAME} characters)")
    return models


def _providers(table: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, ProviderConfig]:
    providers = _default_providers()
    for name, spec in table.items():
        if not isinstance(spec, Mapping):
            raise SettingsError(f"providers.{name} must be a table")
        known = {f.name for f in dataclasses.fields(ProviderConfig)} - {"name"}
        unknown = set(spec) - known
        if unknown:
            raise SettingsError(f"providers.{name}: unknown keys {sorted(unknown)}")
        # A table without `models` offers none of the defaults of a provider of another kind.
        base = providers.get(name, ProviderConfig(name, str(spec.get("kind", name))))
        if "kind" in spec and spec["kind"] != base.kind:
            base = dataclasses.replace(base, models=())
        values = dict(spec)
        if "models" in values:
            values["models"] = _model_list(name, values["models"], "the config file")
        try:
            providers[name] = dataclasses.replace(base, **{
                k: (float(v) if k == "timeout_s" else v if k == "models" else str(v))
                for k, v in values.items()})
        except (TypeError, ValueError):
            raise SettingsError(f"providers.{name}: invalid value") from None
    # AGENTD_<PROVIDER>_BASE_URL, _API_KEY_ENV, _TIMEOUT_S, _MODEL_PATH, _MODELS override the file.
    for name, provider in list(providers.items()):
        changes: dict[str, Any] = {}
        for key in ("base_url", "api_key_env", "timeout_s", "model_path", "models"):
            variable = f"{ENV_PREFIX}{name.upper()}_{key.upper()}"
            value = env.get(variable)
            if value is None:
                continue
            if key == "timeout_s":
                changes[key] = float(value)
            elif key == "models":
                changes[key] = _model_list(name, value, variable)
            else:
                changes[key] = value
        if changes:
            providers[name] = dataclasses.replace(provider, **changes)
    return providers


def load_settings(config_file: Path | None = None, *, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """Resolve settings from all sources; raises SettingsError naming the offending key."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    explicit = config_file is not None or f"{ENV_PREFIX}CONFIG" in env
    path = config_file or Path(env.get(f"{ENV_PREFIX}CONFIG", default_config_path()))
    table: dict[str, Any] = {}
    if path.exists():
        try:
            table = tomllib.loads(path.read_text("utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path}: {exc}") from None
    elif explicit:
        raise SettingsError(f"config file {path} does not exist")
    provider_table = table.pop("providers", {})
    for key, value in table.items():
        if key not in _SCALARS:
            raise SettingsError(f"config file {path}: unknown key {key!r}")
        values[key] = _coerce(key, value, str(path))
    for key in _SCALARS:
        if _env(key) in env:
            values[key] = _coerce(key, env[_env(key)], _env(key))
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _coerce(key, value, f"--{key.replace('_', '-')}")
    values["providers"] = _providers(provider_table, env)
    return Settings(**values).validate()
