"""Model providers behind one interface, resolved from a run's `<provider>:<model>` name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentd.providers.base import Provider, ProviderError, UnknownModel
from agentd.providers.demo import DemoProvider
from agentd.providers.demo import validate_params as validate_demo_params
from agentd.providers.params import validate_sampling_params
from agentd.settings import ProviderConfig, Settings


@dataclass(frozen=True, slots=True)
class ModelRef:
    provider: str  # the [providers.<name>] table
    model: str  # what the provider calls the model

    def __str__(self) -> str:
        if self.provider == "demo" and self.model == "demo":
            return "demo"
        return f"{self.provider}:{self.model}"


def parse_model(name: str | None, settings: Settings) -> ModelRef:
    """`demo`, `<provider>:<model>`, or None for the default; raises UnknownModel."""
    name = (name or settings.default_model).strip()
    provider, sep, model = name.partition(":")
    if provider not in settings.providers:
        raise UnknownModel(f"unknown model provider {provider!r} (known: "
                           f"{', '.join(sorted(settings.providers))})")
    config = settings.providers[provider]
    if config.kind == "demo":
        return ModelRef(provider, model or "demo")
    if not sep or not model:
        raise UnknownModel(f"model {name!r} must be written as {provider}:<model>")
    return ModelRef(provider, model)


def validate_params(config: ProviderConfig, params: dict[str, Any],
                    max_run_s: float | None = None) -> dict[str, Any]:
    """A run's params for the provider it names; raises ValueError naming the bad one."""
    if config.kind == "demo":
        return validate_demo_params(params, max_run_s)
    return validate_sampling_params(config.kind, params)


class ProviderRegistry:
    """Builds each configured provider once, on first use; remote ones share one HTTP client
    each (closed by `close`)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._built: dict[str, Provider] = {}

    def resolve(self, ref: ModelRef) -> Provider:
        if ref.provider not in self._built:
            self._built[ref.provider] = self._build(self._settings.providers[ref.provider])
        return self._built[ref.provider]

    def _build(self, config: ProviderConfig) -> Provider:
        if config.kind == "demo":
            return DemoProvider()
        if config.kind == "openai":
            from agentd.providers.openai import OpenAIProvider

            return OpenAIProvider(config)
        if config.kind == "anthropic":
            from agentd.providers.anthropic import AnthropicProvider

            return AnthropicProvider(config)
        if config.kind == "local":
            from agentd.providers.local import LocalProvider

            return LocalProvider(config)
        raise ProviderError(f"provider kind {config.kind!r} is not available in this build",
                            "model_unavailable")

    async def close(self) -> None:
        built, self._built = list(self._built.values()), {}
        for provider in built:
            close = getattr(provider, "aclose", None)
            if close is not None:
                await close()

    aclose = close
