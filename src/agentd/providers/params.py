"""Per-run `params` for the real providers, checked at enqueue so a typo is a 422, not a failed run.

Only sampling settings every such provider understands pass through, plus `system` (a system
prompt for the turn). The demo provider has its own params (providers.demo).
"""

from __future__ import annotations

from typing import Any

MAX_SYSTEM_CHARS = 100_000
MAX_STOP_SEQUENCES = 8

# name: (kinds that accept it, type, low, high)
_NUMERIC: dict[str, tuple[frozenset[str], type, float, float]] = {
    "temperature": (frozenset({"openai", "anthropic", "local"}), float, 0.0, 2.0),
    "top_p": (frozenset({"openai", "anthropic", "local"}), float, 0.0, 1.0),
    "top_k": (frozenset({"anthropic", "local"}), int, 1, 1000),
    "max_tokens": (frozenset({"openai", "anthropic", "local"}), int, 1, 1_000_000),
    "seed": (frozenset({"openai", "local"}), int, 0, 2**63 - 1),
    "presence_penalty": (frozenset({"openai"}), float, -2.0, 2.0),
    "frequency_penalty": (frozenset({"openai"}), float, -2.0, 2.0),
}


def validate_sampling_params(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """Raises ValueError naming the first bad param."""
    known = {name for name, spec in _NUMERIC.items() if kind in spec[0]} | {"system", "stop"}
    unknown = set(params) - known
    if unknown:
        raise ValueError(f"unknown params for a {kind} model: {sorted(unknown)} "
                         f"(known: {sorted(known)})")
    for name, value in params.items():
        if name == "system":
            if not isinstance(value, str) or len(value) > MAX_SYSTEM_CHARS:
                raise ValueError(f"params.system must be a string of at most "
                                 f"{MAX_SYSTEM_CHARS} characters")
        elif name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not 0 < len(stops) <= MAX_STOP_SEQUENCES or \
                    not all(isinstance(s, str) and 0 < len(s) <= 200 for s in stops):
                raise ValueError(f"params.stop must be a string or a list of at most "
                                 f"{MAX_STOP_SEQUENCES} non-empty strings")
        else:
            _, kind_of, low, high = _NUMERIC[name]
            numeric = isinstance(value, int) if kind_of is int else \
                isinstance(value, (int, float))
            if isinstance(value, bool) or not numeric or not low <= value <= high:
                what = "an integer" if kind_of is int else "a number"
                raise ValueError(f"params.{name} must be {what} in [{low:g}, {high:g}]")
    return params
