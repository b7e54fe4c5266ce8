"""Settings resolve defaults < config file < AGENTTUI_* < flags, and say which value is wrong."""

from __future__ import annotations

import stat
import tomllib
from pathlib import Path

import pytest

from agenttui.client import DEFAULT_URL
from agenttui.locations import config_file, write_client_config
from agenttui.settings import Settings, SettingsError, load_settings


def test_precedence_defaults_config_env_flags() -> None:
    assert load_settings(config={}, env={}) == Settings()
    config = {"url": "http://desk:8740/", "token": "agd_cfg", "theme": "nord",
              "keys": {"stop": "f8"}, "params": {"tokens": 5}, "timeout_s": 3,
              "someone_elses": "ignored"}
    settings = load_settings(config=config, env={})
    assert (settings.url, settings.token, settings.theme) == ("http://desk:8740", "agd_cfg",
                                                                "nord")
    assert settings.keys == {"stop": "f8"} and settings.params == {"tokens": 5}
    env = {"AGENTTUI_TOKEN": "agd_env", "AGENTTUI_KEYS": "stop=f9; send = enter",
           "AGENTTUI_PARAMS": '{"tokens": 7}', "AGENTTUI_EXPORT_DIR": "~/exports"}
    settings = load_settings(config=config, env=env, url="http://laptop:1", token=None)
    assert (settings.url, settings.token) == ("http://laptop:1", "agd_env")
    assert settings.keys == {"stop": "f9", "send": "enter"}
    assert settings.params == {"tokens": 7}
    assert settings.export_dir == Path("~/exports").expanduser()
    assert load_settings(config={}, env={}).url == DEFAULT_URL


def test_the_stored_token_and_pin_go_only_to_the_daemon_they_were_stored_for() -> None:
    config = {"url": "https://desk:8740", "token": "agd_desk", "device": "laptop",
              "fingerprint": "SHA256:" + "ab" * 32}
    same = load_settings(config=config, env={}, url="https://desk:8740/")
    assert (same.token, same.fingerprint) == ("agd_desk", config["fingerprint"])
    # Another URL, by a flag or the environment: http:// would carry the token in clear text.
    for flags, env in (({"url": "http://desk:8740"}, {}),
                       ({}, {"AGENTTUI_URL": "https://elsewhere:8740"})):
        other = load_settings(config=config, env=env, **flags)
        assert (other.token, other.fingerprint, other.device) == (None, None, None), flags
    # The same daemon spelled another way keeps them: case, a default port, a trailing slash,
    # and any loopback name for a daemon on this machine.
    assert load_settings(config=config, env={}, url="https://DESK:8740/").token == "agd_desk"
    assert load_settings(config={**config, "url": "https://desk"}, env={},
                         url="https://desk:443").token == "agd_desk"
    local = {"url": "http://127.0.0.1:8740", "token": "agd_local"}
    for url in ("http://localhost:8740", "http://[::1]:8740", "http://127.0.0.1:8740/"):
        assert load_settings(config=local, env={}, url=url).token == "agd_local", url
    assert load_settings(config=local, env={}, url="http://127.0.0.1:8741").token is None
    # A config that names no URL holds the default daemon's token, and only its.
    bare = {"token": "agd_bare"}
    assert load_settings(config=bare, env={}).token == "agd_bare"
    assert load_settings(config=bare, env={}, url="http://elsewhere:8740").token is None
    # A token the user gives for that URL is theirs to send.
    chosen = load_settings(config=config, env={"AGENTTUI_TOKEN": "agd_mine"},
                           url="http://desk:8740")
    assert (chosen.token, chosen.fingerprint) == ("agd_mine", None)


@pytest.mark.parametrize(("config", "env", "named"), [
    ({"url": 5}, {}, "url in the config file"),
    ({}, {"AGENTTUI_TIMEOUT_S": "soon"}, "timeout_s in $AGENTTUI_TIMEOUT_S"),
    ({"keys": {"stop": ""}}, {}, "keys in the config file"),
    ({}, {"AGENTTUI_KEYS": "stop"}, "keys in $AGENTTUI_KEYS"),
    ({}, {"AGENTTUI_PARAMS": "[1]"}, "params in $AGENTTUI_PARAMS"),
])
def test_a_bad_value_names_itself_and_its_source(config: dict, env: dict, named: str) -> None:
    with pytest.raises(SettingsError, match=named.replace("$", r"\$")):
        load_settings(config=config, env=env)


def test_config_file_is_0600_and_keeps_the_users_other_settings() -> None:
    path = config_file()
    path.write_text('theme = "nord"\nparams = { tokens = 5 }\n\n[keys]\nstop = "f8"\n'
                    '"copy answer" = "ctrl+k"\n')
    write_client_config("http://desk:8740", 'agd_"quoted"\\token', device="desk")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert tomllib.loads(path.read_text()) == {
        "url": "http://desk:8740", "token": 'agd_"quoted"\\token', "device": "desk",
        "theme": "nord", "params": {"tokens": 5},
        "keys": {"stop": "f8", "copy answer": "ctrl+k"}}
    assert load_settings(env={}).keys == {"stop": "f8", "copy answer": "ctrl+k"}
