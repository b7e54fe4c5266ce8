"""The models on offer: what `models` configures, which ones can run now and why not, in words
that never carry a key variable, a URL or a path."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentd.providers import catalog, parse_model
from agentd.providers.catalog import ModelRefused, check_usable, offers
from agentd.settings import SettingsError, load_settings


def settings_with(tmp_path: Path, toml: str = "", **env: str):
    config = tmp_path / "agentd.toml"
    config.write_text(toml, "utf-8")
    return load_settings(config, env=env)


def by_name(settings) -> dict[str, catalog.Offer]:
    return {offer.name: offer for offer in offers(settings)}


def test_models_come_from_the_config_file_and_the_environment(tmp_path: Path) -> None:
    settings = settings_with(
        tmp_path, '[providers.ollama]\nkind = "openai"\nbase_url = "http://127.0.0.1:11434/v1"\n'
                  'models = ["llama3.2", "qwen2.5:0.5b"]\n',
        AGENTD_ANTHROPIC_MODELS="claude-a, claude-b ,")
    assert settings.providers["ollama"].models == ("llama3.2", "qwen2.5:0.5b")
    assert settings.providers["anthropic"].models == ("claude-a", "claude-b")
    names = set(by_name(settings))
    assert {"demo", "ollama:llama3.2", "ollama:qwen2.5:0.5b", "anthropic:claude-a",
            "local:smollm2"} <= names
    assert "anthropic:claude-sonnet-4-0" not in names  # the list replaces the defaults


@pytest.mark.parametrize("toml", [
    '[providers.openai]\nmodels = [1, 2]\n',
    '[providers.openai]\nmodels = ["two words"]\n',
    f'[providers.openai]\nmodels = ["{"m" * 200}"]\n',
])
def test_a_bad_models_list_is_refused_naming_it(tmp_path: Path, toml: str) -> None:
    with pytest.raises(SettingsError, match=r"providers\.openai\.models"):
        settings_with(tmp_path, toml)


def test_usable_depends_on_keys_and_files_and_reasons_keep_secrets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.setattr(catalog, "local_runtime_installed", lambda: True)
    missing = tmp_path / "secret-dir" / "weights.gguf"
    settings = settings_with(
        tmp_path, '[providers.ollama]\nkind = "openai"\nmodels = ["llama3.2"]\n',
        AGENTD_LOCAL_MODEL_PATH=str(missing))
    found = by_name(settings)
    assert found["demo"].usable and found["demo"].reason is None
    assert found["ollama:llama3.2"].usable  # a server that names no key variable needs none
    assert not found["openai:gpt-4o"].usable and not found["anthropic:claude-sonnet-4-0"].usable
    assert found["local:weights"].reason == "the model file is missing on the daemon"
    for offer in found.values():
        for secret in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "://", str(tmp_path), "gguf"):
            assert secret not in (offer.reason or ""), offer

    missing.parent.mkdir()
    missing.write_bytes(b"GGUF")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    found = by_name(settings)
    assert found["openai:gpt-4o"].usable and found["local:weights"].usable
    monkeypatch.setattr(catalog, "local_runtime_installed", lambda: False)
    assert "llama-cpp-python" in (by_name(settings)["local:weights"].reason or "")


def test_check_usable_names_the_model_and_says_which_refusal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    settings = settings_with(tmp_path)
    check_usable(parse_model("demo", settings), settings)
    with pytest.raises(ModelRefused) as unknown:
        check_usable(parse_model("openai:gpt-5-nonexistent", settings), settings)
    assert unknown.value.code == "unknown_model"
    assert "openai:gpt-5-nonexistent" in unknown.value.message
    with pytest.raises(ModelRefused) as unusable:
        check_usable(parse_model("openai:gpt-4o", settings), settings)
    assert unusable.value.code == "model_unavailable"
    assert "openai:gpt-4o" in unusable.value.message
    with pytest.raises(ModelRefused, match="unknown"):
        check_usable(parse_model("demo:x" + "y" * 300, settings), settings)


def test_a_switched_off_provider_is_offered_to_nobody_and_refused(tmp_path: Path) -> None:
    settings = settings_with(tmp_path, "[providers.demo]\nenabled = false\n",
                             AGENTD_OPENAI_ENABLED="no")
    names = set(by_name(settings))
    assert "demo" not in names and not any(n.startswith("openai:") for n in names)
    with pytest.raises(ModelRefused) as refused:
        check_usable(parse_model("demo", settings), settings)
    assert refused.value.code == "model_unavailable"
    assert "switched off" in refused.value.message
    assert settings_with(tmp_path, "", AGENTD_DEMO_ENABLED="1").providers["demo"].enabled
    with pytest.raises(SettingsError, match="AGENTD_DEMO_ENABLED"):
        settings_with(tmp_path, "", AGENTD_DEMO_ENABLED="perhaps")


def test_doctor_names_what_keeps_each_provider_from_running(tmp_path: Path,
                                                           monkeypatch) -> None:
    monkeypatch.delenv("AGENTD_TEST_CATALOG_KEY", raising=False)
    settings = settings_with(
        tmp_path, '[providers.demo]\nenabled = false\n[providers.openai]\n'
                  'api_key_env = "AGENTD_TEST_CATALOG_KEY"\n',
        AGENTD_DEFAULT_MODEL="openai:gpt-4o")
    checks = {c.provider: c for c in catalog.provider_checks(settings)}
    assert checks["demo"].ok and "switched off" in checks["demo"].detail
    # The default model's provider cannot run: a fault, naming the variable to set.
    assert not checks["openai"].ok and not checks["openai"].usable
    assert "AGENTD_TEST_CATALOG_KEY is not set" in checks["openai"].detail
    # Another unusable provider is worth knowing, not a fault.
    assert checks["anthropic"].ok and not checks["anthropic"].usable
    monkeypatch.setenv("AGENTD_TEST_CATALOG_KEY", "sk-test")
    checks = {c.provider: c for c in catalog.provider_checks(settings)}
    assert checks["openai"].ok and checks["openai"].usable
    assert "openai:gpt-4o" in checks["openai"].detail
