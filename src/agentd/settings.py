"""One typed settings object: defaults, then the config file, then AGENTD_* variables, then flags.

Every setting has all four spellings; an invalid value fails at start with the key's name.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import platformdirs

from agentd.tool_settings import (
    McpServerConfig,
    ToolSettingsError,
    parse_mcp,
    parse_tool_policies,
)
from agentd.vocabulary import ApprovalPolicy

ENV_PREFIX = "AGENTD_"
MAX_MODEL_NAME = 200  # `<provider>:<model>`, as the API accepts it and a conversation stores it
# The largest limits an operator may set (a larger one is a typo, not a plan).
MAX_ACCOUNT_RUNNING = 10_000
MAX_ACCOUNT_QUEUED = 1_000_000
MAX_RUN_S = 86_400
MAX_WORKERS = 256


def dsn_problem(dsn: str | None) -> str | None:
    """What makes `dsn` unusable as asyncpg's connection URL, without echoing it (it may hold a
    password); None when it looks usable (the server may still refuse it)."""
    if dsn is None:
        return None
    if not dsn.startswith(("postgresql://", "postgres://")):
        return ("must be a postgresql:// URL, e.g. postgresql://user@host:5432/dbname "
                "(the key=value form is not accepted)")
    try:
        parts = urlsplit(dsn)  # a port list (several hosts) is asyncpg's to parse, at connect
    except ValueError as exc:
        return f"is not a valid URL: {exc}"
    # A '#', '/' or '?' left as is in the password ends the URL's host part early: what
    # follows would be read as a port, and asyncpg's error would quote that piece of it.
    encode = ("percent-encode special characters in the user name and password "
              "(%23 for #, %2F for /, %3F for ?, %40 for @)")
    if parts.fragment or "#" in dsn:
        return f"holds a '#': {encode}"
    for host in parts.netloc.rpartition("@")[2].split(","):
        after = host.rpartition("]")[2] if host.startswith("[") else host  # [IPv6]:port
        digits = after.rpartition(":")[2] if ":" in after else ""
        if digits and not digits.isdigit():
            return f"has a port that is not a number: {encode}"
    return None


class SettingsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    """One `[providers.<name>]` table: how to reach a model provider."""

    name: str
    kind: str  # demo | openai | anthropic | local
    base_url: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 60.0  # the longest silence (connect, first byte, between events)
    model_path: str | None = None
    # The models it offers (GET /v1/models, and what enqueue accepts): `<name>:<model>` for each.
    # Empty for a `local` provider with a model_path: it offers that file, named by its stem.
    models: tuple[str, ...] = ()
    enabled: bool = True  # false: offered to nobody, refused at enqueue (e.g. the demo model)
    call_timeout_s: float = 300.0  # one model call, from request to its last event


@dataclass(frozen=True, slots=True)
class Settings:
    dsn: str | None = None  # None: run the embedded PostgreSQL
    hub_dsn: str | None = None  # LISTEN must bypass transaction poolers; defaults to dsn
    # "transaction": dsn goes through a transaction pooler (PgBouncer pool_mode = transaction):
    # no prepared-statement cache and no session settings on the pool; migrations, the hub and
    # the heartbeat connection use hub_dsn, which must then reach PostgreSQL directly.
    pooler: str = "none"
    listen: str = "127.0.0.1:8740"
    data_dir: Path | None = None  # embedded PostgreSQL's root; None: the platform default
    pg_user: str | None = None  # account the embedded server runs as when agentd is root
    lease_ttl_s: float = 30.0
    heartbeat_s: float = 10.0
    reap_interval_s: float = 5.0
    reap_grace_s: float = 5.0
    tick_s: float = 10.0
    # Worker processes behind the one listen address (0: one per core). max_runs and pool_max
    # are per worker: N workers run up to N x max_runs turns on up to N x pool_max connections.
    workers: int = 0
    max_runs: int = 16
    claim_batch: int = 8  # at most this many turns per claim statement, when slots are free
    # A turn posted here while a slot is free is claimed in the enqueue's own transaction.
    claim_on_enqueue: bool = True
    # Admission by capacity: claim only while the event loop's lag and the pool's wait stayed
    # below these over the last second (a process that lags cannot keep its leases).
    max_loop_lag_ms: int = 250
    max_pool_wait_ms: int = 250
    drain_s: float = 25.0
    flush_ms: int = 250
    pool_max: int = 20
    journal_retention_s: float = 86_400.0
    keepalive_s: float = 15.0
    default_model: str = "demo"
    max_tool_steps: int = 8
    approval_timeout_s: float = 600.0  # an undecided `ask` tool call is denied after this
    # Fair and bounded (docs/operations.md, "Per-account limits"): what an account that sets
    # none of its own gets (`agentd account set` overrides them per account, in the database),
    # and a turn's deadline from its claim.
    account_max_running: int = 16
    account_max_queued: int = 1000
    max_run_s: float = 600.0
    max_content_chars: int = 100_000
    log_level: str = "info"
    # Reaching agentd from other machines (docs/operations.md, "Attach from another machine").
    tls: str = "auto"  # auto: HTTPS on a non-loopback listen address | on | off
    tls_cert: Path | None = None  # a real certificate (PEM); None: self-signed in the data dir
    tls_key: Path | None = None
    tls_names: str = ""  # extra host names/addresses for the self-signed certificate, commas
    insecure_http: bool = False  # plain HTTP on a non-loopback address (warned at every start)
    public_url: str | None = None  # how other machines reach us (pairing lines); None: derived
    pairing_ttl_s: float = 600.0
    pair_attempts_per_min: int = 10  # POST /v1/pair per client address
    streams_per_device: int = 16
    max_connections: int = 1000
    max_connections_per_address: int = 200  # one client address (IPv6: /64); loopback is not
    header_timeout_s: float = 10.0  # a request head must arrive whole within this
    body_timeout_s: float = 30.0  # and its body within this
    idle_timeout_s: float = 60.0  # an idle keep-alive connection is closed after this
    providers: Mapping[str, ProviderConfig] = field(default_factory=dict)
    mcp: Mapping[str, McpServerConfig] = field(default_factory=dict)  # [mcp.<name>]
    tool_policies: Mapping[str, ApprovalPolicy] = field(default_factory=dict)  # [tools]

    def validate(self) -> Settings:
        positive = ("lease_ttl_s", "heartbeat_s", "reap_interval_s", "tick_s", "flush_ms",
                    "keepalive_s", "pairing_ttl_s", "header_timeout_s", "body_timeout_s",
                    "idle_timeout_s", "approval_timeout_s", "max_loop_lag_ms",
                    "max_pool_wait_ms")
        for key in positive:
            if getattr(self, key) <= 0:
                raise SettingsError(f"{key} ({_env(key)}) must be > 0")
        for key in ("max_runs", "claim_batch", "pool_max", "max_tool_steps", "max_content_chars",
                    "pair_attempts_per_min", "streams_per_device", "max_connections",
                    "max_connections_per_address"):
            if getattr(self, key) < 1:
                raise SettingsError(f"{key} ({_env(key)}) must be >= 1")
        if not 0 <= self.workers <= MAX_WORKERS:
            raise SettingsError(f"workers ({_env('workers')}) must be between 0 (one per core) "
                                f"and {MAX_WORKERS}")
        for key in ("drain_s", "reap_grace_s", "journal_retention_s"):
            if getattr(self, key) < 0:
                raise SettingsError(f"{key} ({_env(key)}) must be >= 0")
        if self.heartbeat_s > self.lease_ttl_s / 3:
            raise SettingsError(
                f"heartbeat_s ({self.heartbeat_s}) must be at most lease_ttl_s/3 "
                f"({self.lease_ttl_s / 3:g}) so a lease survives two missed beats")
        for key in ("dsn", "hub_dsn"):
            problem = dsn_problem(getattr(self, key))
            if problem:
                raise SettingsError(f"{key} ({_env(key)}) {problem}")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SettingsError(f"listen ({_env('listen')}) must be HOST:PORT, got "
                                f"{self.listen!r}")
        if self.pooler not in ("none", "transaction"):
            raise SettingsError(f"pooler ({_env('pooler')}) must be none or transaction, got "
                                f"{self.pooler!r}")
        if self.pooler == "transaction" and not (self.dsn and self.hub_dsn):
            raise SettingsError("pooler = transaction needs dsn (through the pooler) and hub_dsn "
                                "(PostgreSQL itself: LISTEN, migrations and heartbeats need a "
                                "session of their own)")
        if self.tls not in ("auto", "on", "off"):
            raise SettingsError(f"tls ({_env('tls')}) must be auto, on or off, got {self.tls!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingsError("tls_cert and tls_key (AGENTD_TLS_CERT, AGENTD_TLS_KEY) go "
                                "together: give both or neither")
        if self.tls == "on" and self.insecure_http:
            raise SettingsError("tls = on and insecure_http contradict each other")
        if self.tls == "off" and not self.insecure_http and not self.listen_is_loopback:
            raise SettingsError(
                f"tls = off on the non-loopback address {self.listen} would send tokens in "
                "clear text: also set insecure_http (--insecure-http) if you mean it, or put "
                "a TLS reverse proxy in front and listen on 127.0.0.1")
        if self.public_url is not None and not self.public_url.startswith(
                ("http://", "https://")):
            raise SettingsError(f"public_url ({_env('public_url')}) must start with http:// "
                                f"or https://, got {self.public_url!r}")
        for name in self.extra_tls_names:
            try:
                certificate_name(name)
            except ValueError as exc:
                raise SettingsError(f"tls_names ({_env('tls_names')}): {exc}") from None
        if self.public_url is not None:
            try:
                certificate_name(urlsplit(self.public_url).hostname or "")
            except ValueError as exc:
                raise SettingsError(f"public_url ({_env('public_url')}): its host {exc}"
                                    ) from None
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise SettingsError("log_level (AGENTD_LOG_LEVEL) must be debug|info|warning|error")
        for key, low, high in (("account_max_running", 1, MAX_ACCOUNT_RUNNING),
                               ("account_max_queued", 1, MAX_ACCOUNT_QUEUED),
                               ("max_run_s", 1, MAX_RUN_S)):
            if not low <= getattr(self, key) <= high:
                raise SettingsError(f"{key} ({_env(key)}) must be between {low} and {high:,}")
        for provider in self.providers.values():
            if provider.kind not in ("demo", "openai", "anthropic", "local"):
                raise SettingsError(f"providers.{provider.name}.kind must be demo, openai, "
                                    f"anthropic or local, got {provider.kind!r}")
            for key in ("timeout_s", "call_timeout_s"):
                if not getattr(provider, key) > 0:
                    raise SettingsError(f"providers.{provider.name}.{key} must be > 0")
        return self

    @property
    def pooled(self) -> bool:
        """The pool's DSN goes through a transaction pooler."""
        return self.pooler == "transaction"

    def direct_dsn(self, dsn: str) -> str:
        """Where sessions that need one go (migrations' lock, the heartbeat): `dsn` (the
        database's) unless that goes through a transaction pooler, then hub_dsn."""
        return self.hub_dsn if self.pooled and self.hub_dsn else dsn

    @property
    def extra_tls_names(self) -> list[str]:
        """`tls_names`, one name or address each."""
        return [n.strip() for n in self.tls_names.split(",") if n.strip()]

    @property
    def listen_host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def listen_port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @property
    def listen_is_loopback(self) -> bool:
        return is_loopback_host(self.listen_host)

    @property
    def serves_tls(self) -> bool:
        """HTTPS on this listen address? Loopback stays plain HTTP unless tls = on."""
        if self.tls == "on":
            return True
        if self.tls == "off" or self.insecure_http:
            return False
        return not self.listen_is_loopback


def literal_loopback(host: str) -> bool:
    """Whether `host` is `localhost` or a loopback address as written (nothing resolved)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def certificate_name(name: str) -> str:
    """`name` as a certificate names it: an address as written, a host name in ASCII (its
    A-label: "bücher.lan" is "xn--bcher-kva.lan"). ValueError if it is neither."""
    try:
        return str(ipaddress.ip_address(name.strip("[]")))  # "[2001:db8::1]" as in a URL
    except ValueError:
        pass
    try:
        ascii_name = name.encode("idna").decode("ascii")
    except UnicodeError:
        raise ValueError(f"{name!r} is neither an address nor a host name") from None
    if not ascii_name or any(c.isspace() or c in "/:@[]" for c in ascii_name):
        raise ValueError(f"{name!r} is neither an address nor a host name")
    return ascii_name.lower()


def is_loopback_host(host: str) -> bool:
    """Whether `host` names this machine's loopback only (a name must resolve to nothing else)."""
    if literal_loopback(host):
        return True
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        return False  # an address, and not a loopback one
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    addresses = {str(info[4][0]) for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _env(key: str) -> str:
    return ENV_PREFIX + key.upper()


def default_config_path() -> Path:
    return platformdirs.user_config_path("agentd") / "config.toml"


_TABLES = ("providers", "mcp", "tool_policies")
_SCALARS = {f.name: f for f in dataclasses.fields(Settings) if f.name not in _TABLES}


def _coerce(key: str, value: Any, source: str) -> Any:
    kind = _SCALARS[key].type
    try:
        if value is None:
            return None
        if "Path" in kind:
            # Empty means unset, as for the text keys: Path("") is the working directory, where
            # a template's unset variable would put the cluster and its keys.
            text = str(value)
            return None if ("None" in kind and text == "") else Path(os.path.expanduser(text))
        if kind.startswith("float"):
            return _finite(value)
        if kind.startswith("bool"):
            return _boolean(value)
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


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(value)


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
                k: v if k == "models" else _provider_value(k, v) for k, v in values.items()})
        except (TypeError, ValueError):
            raise SettingsError(f"providers.{name}: invalid value") from None
    # AGENTD_<PROVIDER>_BASE_URL, _API_KEY_ENV, _TIMEOUT_S, _MODEL_PATH, _MODELS, _ENABLED,
    # _CALL_TIMEOUT_S override the file.
    for name, provider in list(providers.items()):
        changes: dict[str, Any] = {}
        for key in ("base_url", "api_key_env", "timeout_s", "model_path", "models", "enabled",
                    "call_timeout_s"):
            variable = f"{ENV_PREFIX}{name.upper()}_{key.upper()}"
            value = env.get(variable)
            if value is None:
                continue
            if key == "models":
                changes[key] = _model_list(name, value, variable)
                continue
            try:
                changes[key] = _provider_value(key, value)
            except ValueError:
                raise SettingsError(f"{variable}: {value!r} is not valid") from None
        if changes:
            providers[name] = dataclasses.replace(provider, **changes)
    return providers


def _finite(value: Any) -> float:
    """A number of seconds or milliseconds: inf and nan are refused (nan passes every `<= 0`
    check, and inf overflows the arithmetic done with it, at the worst moment: a drain)."""
    number = float(value)
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(value)
    return number


def _provider_value(key: str, value: Any) -> Any:
    if key in ("timeout_s", "call_timeout_s"):
        return _finite(value)
    if key == "enabled":
        return _boolean(value)
    return str(value)


@dataclass(frozen=True)
class ConfigSource:
    """The config file as read once: its path (for messages) and its text (None: no file)."""

    path: Path
    text: str | None


def config_path(config_file: Path | None = None, *,
                env: Mapping[str, str] | None = None) -> tuple[Path, bool]:
    """The config file's path, and whether it was named (--config or AGENTD_CONFIG)."""
    env = os.environ if env is None else env
    explicit = config_file is not None or f"{ENV_PREFIX}CONFIG" in env
    return config_file or Path(env.get(f"{ENV_PREFIX}CONFIG", default_config_path())), explicit


def read_config(config_file: Path | None = None, *,
                env: Mapping[str, str] | None = None) -> ConfigSource:
    """The config file `load_settings` would read: --config, else AGENTD_CONFIG, else the
    default path. A file named explicitly must exist; the default one may be absent."""
    path, explicit = config_path(config_file, env=env)
    try:
        return ConfigSource(path, path.read_text("utf-8"))
    except FileNotFoundError:
        if explicit:
            raise SettingsError(f"config file {path} does not exist") from None
        return ConfigSource(path, None)
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"config file {path}: {exc}") from None


def load_settings(config_file: Path | None = None, *, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None,
                  source: ConfigSource | None = None) -> Settings:
    """Resolve settings from all sources; raises SettingsError naming the offending key.

    `source` is a config file already read (a supervised worker gets its supervisor's, so a
    file edited since cannot give one worker settings its siblings do not have)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    source = source or read_config(config_file, env=env)
    path = source.path
    table: dict[str, Any] = {}
    if source.text is not None:
        try:
            table = tomllib.loads(source.text)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path}: {exc}") from None
    provider_table = table.pop("providers", {})
    if not isinstance(provider_table, Mapping):
        raise SettingsError(f"config file {path}: providers must be a table "
                            "([providers.<name>] sections)")
    try:
        mcp = parse_mcp(table.pop("mcp", {}))
        tool_policies = parse_tool_policies(table.pop("tools", {}))
    except ToolSettingsError as exc:
        raise SettingsError(f"config file {path}: {exc}") from None
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
    values["mcp"] = mcp
    values["tool_policies"] = tool_policies
    return Settings(**values).validate()
