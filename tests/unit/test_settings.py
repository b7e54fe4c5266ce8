"""Settings resolve defaults → file → AGENTD_* → flags, and bad values name their key."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentd.settings import SettingsError, load_settings


def test_defaults_are_the_documented_ones(tmp_path: Path) -> None:
    s = load_settings(env={"AGENTD_CONFIG": str(_write(tmp_path, ""))})
    assert (s.listen, s.lease_ttl_s, s.heartbeat_s, s.tick_s, s.flush_ms) == \
        ("127.0.0.1:8740", 30.0, 10.0, 10.0, 250)
    assert s.dsn is None and s.default_model == "demo"
    assert set(s.providers) >= {"demo", "openai", "anthropic", "local"}


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    config = _write(tmp_path, 'lease_ttl_s = 12\nheartbeat_s = 3\nlisten = "127.0.0.1:9000"\n')
    s = load_settings(config, env={"AGENTD_LEASE_TTL_S": "21"},
                      overrides={"listen": "127.0.0.1:9100"})
    assert s.lease_ttl_s == 21.0  # env beats file
    assert s.heartbeat_s == 3.0  # file beats default
    assert s.listen == "127.0.0.1:9100"  # flag beats everything


@pytest.mark.parametrize(("env", "needle"), [
    ({"AGENTD_LEASE_TTL_S": "abc"}, "lease_ttl_s"),
    ({"AGENTD_MAX_RUNS": "0"}, "max_runs"),
    ({"AGENTD_HEARTBEAT_S": "20"}, "heartbeat_s"),
    ({"AGENTD_LISTEN": "nowhere"}, "listen"),
    ({"AGENTD_LOG_LEVEL": "loud"}, "log_level"),
    ({"AGENTD_MAX_RUNS": "2.5"}, "max_runs"),
])
def test_invalid_values_fail_naming_the_key(tmp_path: Path, env: dict[str, str],
                                            needle: str) -> None:
    env = {"AGENTD_CONFIG": str(_write(tmp_path, "")), **env}
    with pytest.raises(SettingsError, match=needle):
        load_settings(env=env)


@pytest.mark.parametrize("text", [
    "drain_s = inf\n", "lease_ttl_s = nan\n", 'approval_timeout_s = "inf"\n',
    '[providers.openai]\ntimeout_s = inf\n'])
def test_infinite_and_nan_durations_are_refused(tmp_path: Path, text: str) -> None:
    """nan passes every `<= 0` check and inf overflowed the drain's own arithmetic at
    SIGTERM, so the drain never ran."""
    with pytest.raises(SettingsError, match=r"not a valid|not valid|invalid value"):
        load_settings(_write(tmp_path, text), env={})


def test_a_providers_key_that_is_not_a_table_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="providers must be a table"):
        load_settings(_write(tmp_path, 'providers = "openai"\n'), env={})


@pytest.mark.parametrize("password", ["s3cr#et9", "pa/ss9", "pa?ss9"])
def test_a_dsn_whose_password_needs_encoding_is_refused_without_quoting_it(
        tmp_path: Path, password: str) -> None:
    """An unencoded '#', '/' or '?' cuts the URL's host part short; asyncpg then quoted the
    piece of the password it took for a port. The setting is refused, quoting none of it."""
    env = {"AGENTD_CONFIG": str(_write(tmp_path, "")),
           "AGENTD_DSN": f"postgresql://agentd:{password}@db.internal/agentd"}
    with pytest.raises(SettingsError, match="percent-encode") as refused:
        load_settings(env=env)
    assert password[:3] not in str(refused.value)


def test_unknown_file_key_and_missing_explicit_file_are_errors(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="unknown key 'lease'"):
        load_settings(_write(tmp_path, "lease = 3\n"), env={})
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(tmp_path / "missing.toml", env={})


def test_provider_tables_and_env_overrides(tmp_path: Path) -> None:
    config = _write(tmp_path, '[providers.ollama]\nkind = "openai"\n'
                              'base_url = "http://127.0.0.1:11434/v1"\n')
    s = load_settings(config, env={"AGENTD_OPENAI_BASE_URL": "http://127.0.0.1:1/v1",
                                   "AGENTD_LOCAL_MODEL_PATH": "/models/x.gguf"})
    assert s.providers["ollama"].kind == "openai"
    assert s.providers["ollama"].base_url == "http://127.0.0.1:11434/v1"
    assert s.providers["openai"].base_url == "http://127.0.0.1:1/v1"
    assert s.providers["local"].model_path == "/models/x.gguf"
    with pytest.raises(SettingsError, match="kind"):
        load_settings(_write(tmp_path, '[providers.x]\nkind = "nope"\n'), env={})


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / f"config-{abs(hash(text))}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("key", "value"), [
    ("timeout_s", "inf"), ("timeout_s", "nan"), ("start_timeout_s", "nan"),
    ("start_timeout_s", "-inf")])
def test_an_mcp_servers_timeouts_are_finite(tmp_path: Path, key: str, value: str) -> None:
    """An MCP server's timeouts passed nan and inf: no bound on a call, and an undefined timer
    for a start."""
    text = f'[mcp.t]\ncommand = "/bin/true"\n{key} = {value}\n'
    with pytest.raises(SettingsError, match=f"mcp.t.{key} must be a finite number > 0"):
        load_settings(_write(tmp_path, text), env={})


def test_an_empty_path_is_unset_not_the_working_directory(tmp_path: Path) -> None:
    """`AGENTD_DATA_DIR=` (a template's unset variable) put the cluster, its password file and
    the TLS key in whatever directory the daemon started in."""
    env = {"AGENTD_CONFIG": str(_write(tmp_path, 'tls_key = ""\n')), "AGENTD_DATA_DIR": "",
           "AGENTD_TLS_CERT": ""}
    s = load_settings(env=env)
    assert (s.data_dir, s.tls_cert, s.tls_key) == (None, None, None)
