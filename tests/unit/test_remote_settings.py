"""Settings for reaching agentd from other machines: TLS decided by the listen address, plain
HTTP elsewhere only by name, and the limits' documented defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentd.settings import Settings, SettingsError, is_loopback_host, load_settings


def load(tmp_path: Path, **env: str) -> Settings:
    config = tmp_path / "empty.toml"
    config.write_text("")
    return load_settings(config, env={f"AGENTD_{k.upper()}": v for k, v in env.items()})


def test_the_limits_defaults(tmp_path: Path) -> None:
    s = load(tmp_path)
    assert (s.tls, s.insecure_http, s.pairing_ttl_s, s.streams_per_device) == \
        ("auto", False, 600.0, 16)
    assert (s.header_timeout_s, s.idle_timeout_s, s.max_connections) == (10.0, 60.0, 1000)


@pytest.mark.parametrize(("listen", "env", "tls"), [
    ("127.0.0.1:8740", {}, False),
    ("[::1]:8740", {}, False),
    ("localhost:8740", {}, False),
    ("0.0.0.0:8740", {}, True),
    ("192.0.2.10:8740", {}, True),
    ("127.0.0.1:8740", {"tls": "on"}, True),
    ("0.0.0.0:8740", {"insecure_http": "true"}, False),
    ("0.0.0.0:8740", {"tls": "off", "insecure_http": "yes"}, False),
    ("127.0.0.1:8740", {"tls": "off"}, False),
])
def test_tls_follows_the_listen_address(tmp_path: Path, listen: str, env: dict[str, str],
                                        tls: bool) -> None:
    assert load(tmp_path, listen=listen, **env).serves_tls is tls


@pytest.mark.parametrize(("env", "needle"), [
    ({"listen": "0.0.0.0:8740", "tls": "off"}, "insecure_http"),
    ({"tls": "sometimes"}, "tls"),
    ({"tls": "on", "insecure_http": "1"}, "contradict"),
    ({"insecure_http": "perhaps"}, "insecure_http"),
    ({"tls_cert": "/etc/agentd/cert.pem"}, "tls_key"),
    ({"public_url": "desk.lan:8740"}, "public_url"),
    ({"public_url": "https://a..b:8740"}, "public_url"),
    ({"tls_names": "desk.lan, two words"}, "tls_names"),
    ({"tls_names": "a..b"}, "tls_names"),
    ({"streams_per_device": "0"}, "streams_per_device"),
    ({"header_timeout_s": "0"}, "header_timeout_s"),
    ({"pair_attempts_per_min": "0"}, "pair_attempts_per_min"),
])
def test_unsafe_or_invalid_remote_settings_fail_naming_the_key(
        tmp_path: Path, env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        load(tmp_path, **env)


def test_insecure_http_from_the_config_file_is_a_boolean(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('listen = "0.0.0.0:8740"\ninsecure_http = true\n')
    assert load_settings(config, env={}).serves_tls is False


def test_loopback_names() -> None:
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1")
    assert is_loopback_host("localhost") and is_loopback_host("127.5.6.7")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("::")
    assert not is_loopback_host("192.0.2.1") and not is_loopback_host("no-such-host.invalid")
