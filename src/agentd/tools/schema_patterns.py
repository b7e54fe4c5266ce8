"""A tool's input schema matches its regular expressions under a deadline.

jsonschema matches `pattern` and `patternProperties` (and the patterns that decide which
properties are additional) with Python's `re`, which backtracks without bound and holds the
event loop while it does. A tool's schema comes from an MCP server and its arguments from the
model: a pattern such as `^(a|aa)+$` met with a long argument would stop this whole process for
minutes, every turn's heartbeat with it, so every lease it holds would lapse. The `regex` library
matches the same syntax and gives up after a timeout (raising TimeoutError, which the caller
turns into a tool error the model reads). jsonschema has no hook for its regex engine (a pull
request for one is open: python-jsonschema/jsonschema#1561), so the three keywords that match
are restated here on `regex`; their messages are jsonschema's own.

A whole check shares one deadline (`match_budget`), so many matches that each stay under it
cannot add up to minutes. `unevaluatedProperties` also matches `patternProperties`, through
jsonschema's own walk of the schema (`$ref`, `allOf`, ...) which cannot be restated in a few
lines: a schema holding both is refused (`unbounded_matching`), and its tool disabled.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import jsonschema.validators
import regex
from jsonschema import ValidationError
from jsonschema.protocols import Validator

# Long enough for any sane pattern over a tool's arguments (microseconds each), short enough
# that a runaway one costs the event loop no more than a slow statement.
MATCH_TIMEOUT_S = 0.05

_deadline: ContextVar[float | None] = ContextVar("agentd_pattern_deadline", default=None)


@functools.cache
def with_deadline(cls: type[Validator]) -> type[Validator]:
    """`cls` (a jsonschema draft's validator) with its matching keywords on `regex`."""
    keywords = {"pattern": _pattern, "patternProperties": _pattern_properties,
                "additionalProperties": _additional_properties}
    mine = {k: v for k, v in keywords.items() if k in cls.VALIDATORS}
    # A validator instance (the keywords' first argument) has descend(), which the Validator
    # protocol does not name: the keyword functions take it as Any.
    extended: type[Validator] = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
        cls, mine)
    return extended


@contextlib.contextmanager
def match_budget(seconds: float = MATCH_TIMEOUT_S) -> Iterator[None]:
    """Every pattern matched inside shares one deadline, `seconds` from now."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def unbounded_matching(schema: Any) -> bool:
    """Whether `schema` anywhere holds both `unevaluatedProperties` and `patternProperties`,
    whose patterns jsonschema would match with `re`, without a deadline."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            found.update(key for key in node
                         if key in ("unevaluatedProperties", "patternProperties"))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return len(found) == 2


def _search(pattern: str, text: str) -> bool:
    deadline = _deadline.get()
    timeout = MATCH_TIMEOUT_S if deadline is None else deadline - time.monotonic()
    if timeout <= 0:
        raise TimeoutError("the schema's patterns ran out of time")
    return regex.search(pattern, text, timeout=timeout) is not None


def _pattern(validator: Any, pattern: str, instance: Any,
             schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: Mapping[str, Any], instance: Any,
                        schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator: Any, additional: Any, instance: Any,
                           schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = "|".join(schema.get("patternProperties", {}))
    extras = {key for key in instance
              if key not in properties and not (patterns and _search(patterns, key))}
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        listed = ", ".join(repr(each) for each in sorted(extras, key=str))
        if "patternProperties" in schema:
            verb = "does" if len(extras) == 1 else "do"
            regexes = ", ".join(repr(each) for each in sorted(schema["patternProperties"]))
            yield ValidationError(f"{listed} {verb} not match any of the regexes: {regexes}")
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(
                f"Additional properties are not allowed ({listed} {verb} unexpected)")
