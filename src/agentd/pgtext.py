"""Text as PostgreSQL can store it: what a worker writes, made storable in one place.

PostgreSQL text and jsonb hold no NUL (text refuses the byte, jsonb the escape \\u0000 with
SQLSTATE 22P05), UTF-8 has no lone UTF-16 surrogate (the driver cannot encode one), and jsonb
has no NaN or Infinity (Python's json reads and writes them: a tool server or a model may send
one). What a worker writes comes from outside: a model's text, a tool's result, a provider's
error. One such value must not fail the write, and with it the turn: NUL is dropped, a lone
surrogate becomes U+FFFD, and a number that is not finite becomes its name as a string ("NaN").
The API refuses NUL and surrogates in what clients send instead (api/bodies.py): there the
sender can be told.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar, cast

T = TypeVar("T")

_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """`text` without NUL, each lone surrogate as U+FFFD (the same string when it had none)."""
    if "\x00" in text:
        text = text.replace("\x00", "")
    if not text.isascii() and _SURROGATE.search(text) is not None:
        text = _SURROGATE.sub("\ufffd", text)
    return text


def clean(value: T) -> T:
    """A JSON value (dicts, lists, strings, scalars) with every string and key cleaned as
    clean_text does; a value with nothing to clean is returned as it is, not copied."""
    return cast(T, _clean(value))


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)  # "NaN", "Infinity" or "-Infinity", as JSON's readers spell it
    if isinstance(value, dict):
        pairs = [(_clean(k), _clean(v)) for k, v in value.items()]
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(pairs, value.items(), strict=True)):
            return value  # nothing to clean: no copy
        return dict(pairs)
    if isinstance(value, list | tuple):
        items = [_clean(v) for v in value]
        if all(v is v0 for v, v0 in zip(items, value, strict=True)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value
