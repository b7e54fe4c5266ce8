"""The tool registry and the calculator: schema-checked arguments, arithmetic without eval."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from agentd.tools import ToolContext, ToolError, default_tools
from agentd.tools.builtin import evaluate
from agentd.tools.registry import InvalidToolSchema, Tool, compile_schema
from agentd.tools.schema_patterns import match_budget

# The calculator never touches the database; a context without a store is enough.
CTX = ToolContext(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), 1, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("expression", "value"), [
    ("6 * 7", 42), ("2 ** 10", 1024), ("(1 + 2) * 3 - 4 / 2", 7.0), ("7 // 2", 3),
    ("7 % 3", 1), ("-3 ** 2", -9), ("2 ** -2", 0.25), ("1.5e3 + 1", 1501.0),
])
def test_calculator_does_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(("expression", "reason"), [
    ("__import__('os').system('true')", "unsupported element in expression: Call"),
    ("().__class__.__bases__", "unsupported element in expression: Attribute"),
    ("open", "unsupported element in expression: Name"),
    ("[1, 2]", "unsupported element in expression: List"),
    ("'a' * 3", "unsupported element in expression: Constant"),
    ("True + 1", "unsupported element in expression: Constant"),
    ("1j * 1j", "unsupported element in expression: Constant"),
    ("(lambda: 1)()", "unsupported element in expression: Call"),
    ("9 ** 9 ** 9", "exponent too large"),
    ("(10 ** 1000) ** 1000", "number too large"),
    ("10 ** 1000 * 10 ** 1000 * 10 ** 1000", "number too large"),
    ("1e308 * 10", "not a finite number"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 / 0", "division by zero"),
    ("1 +", "not an arithmetic expression"),
    ("x = 1", "not an arithmetic expression"),
])
def test_calculator_refuses_anything_but_bounded_arithmetic(expression: str, reason: str) -> None:
    with pytest.raises(ToolError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        evaluate(expression)


@pytest.mark.parametrize(("name", "args", "reason"), [
    ("calculator", {}, "invalid arguments for calculator: 'expression' is a required property"),
    ("calculator", {"expression": 42}, "at expression: 42 is not of type 'string'"),
    ("calculator", {"expression": "1", "extra": 1}, "Additional properties are not allowed"),
    ("calculator", {"expression": "1" * 501}, "is too long"),
    ("calculator", '{"expression": "6 *', "not a JSON object"),
    ("calculator", ["6 * 7"], "must be a JSON object"),
    ("notes", {"action": "delete"}, "'delete' is not one of"),
    ("notes", {"action": "list", "limit": "10"}, "at limit: '10' is not of type 'integer'"),
    ("rm_rf", {}, "unknown tool"),
])
async def test_bad_arguments_are_a_tool_error_not_a_crash(name: str, args: Any,
                                                          reason: str) -> None:
    with pytest.raises(ToolError, match=reason):
        await default_tools().call(name, args, CTX)


async def test_calculator_through_the_registry() -> None:
    result = await default_tools().call("calculator", {"expression": "6 * 7"}, CTX)
    assert result == {"expression": "6 * 7", "value": 42}


async def test_the_builtins_are_registered_with_schemas() -> None:
    specs = {spec.name: spec for spec in await default_tools().specs()}
    assert set(specs) == {"clock", "calculator", "notes"}
    assert specs["notes"].parameters["properties"]["action"]["enum"] == ["append", "list"]


@pytest.mark.parametrize("draft", [5, {}, ["x"]])
def test_a_schema_whose_draft_jsonschema_cannot_read_disables_that_tool_alone(
        draft: object) -> None:
    """jsonschema raises AttributeError or TypeError for a `$schema` that is no string; it
    escaped the tool list's check and failed every tool of its MCP server (a server built on
    another SDK can send one: the Python SDK's own server refuses it)."""
    with pytest.raises(InvalidToolSchema, match=r"invalid input schema \("):
        compile_schema({"$schema": draft, "type": "object", "properties": {}})


def test_nan_and_infinity_from_a_tool_or_a_model_are_stored_as_their_names() -> None:
    """jsonb has no NaN: a tool result or arguments holding one failed the turn's write."""
    from agentd.pgtext import clean

    value = {"ratio": float("nan"), "top": [float("inf"), -float("inf"), 1.5]}
    assert clean(value) == {"ratio": "NaN", "top": ["Infinity", "-Infinity", 1.5]}
    plain = {"a": [1.0, 2]}
    assert clean(plain) is plain  # nothing to clean: not copied


async def _no_call(args: dict[str, Any], ctx: ToolContext) -> Any:
    raise AssertionError("never called: its arguments are refused")

RUNAWAY = "^(a|aa)+$"  # backtracks without end on Python's re over a long non-match
LONG = "a" * 60 + "!"


@pytest.mark.timeout(60)  # on Python's re this check runs for hours: the timeout fails it
@pytest.mark.parametrize("schema, args", [
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": RUNAWAY}}},
     {"s": LONG}),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "patternProperties": {RUNAWAY: {"type": "string"}}}, {LONG: "x"}),
    ({"type": "object", "properties": {}, "patternProperties": {RUNAWAY: {}},
      "additionalProperties": False}, {LONG: 1}),
])
def test_a_schema_pattern_that_backtracks_without_end_is_a_tool_error_at_once(
        schema: dict[str, Any], args: dict[str, Any]) -> None:
    """A tool's schema comes from an MCP server, its arguments from the model: a pattern that
    backtracks without end held the event loop (every lease of the process with it). It is
    matched under a deadline, and the model reads that its arguments could not be checked."""
    tool = Tool("runaway", "", schema, _no_call)
    with pytest.raises(ToolError, match="took too long to match"):
        tool.check_arguments(args)


@pytest.mark.parametrize("schema, bad, reason, good", [
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}},
     {"code": "abcd"}, r"at code: 'abcd' does not match '\^\[A-Z\]\{3\}\$'", {"code": "ABC"}),
    ({"type": "object", "patternProperties": {"^x-": {"type": "integer"}}},
     {"x-n": "1"}, "at x-n: '1' is not of type 'integer'", {"x-n": 1, "other": "1"}),
    ({"type": "object", "properties": {"a": {}}, "patternProperties": {"^x-": {}},
      "additionalProperties": False}, {"a": 1, "x-n": 2, "b": 3, "c": 4},
     r"'b', 'c' do not match any of the regexes: '\^x-'", {"a": 1, "x-n": 2}),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False},
     {"a": 1, "b": 2}, r"Additional properties are not allowed \('b' was unexpected\)",
     {"a": 1}),
])
def test_patterns_still_check_as_jsonschema_does(schema: dict[str, Any], bad: dict[str, Any],
                                                 reason: str, good: dict[str, Any]) -> None:
    tool = Tool("patterned", "", schema, _no_call)
    with pytest.raises(ToolError, match=reason):
        tool.check_arguments(bad)
    assert tool.check_arguments(good) == good


def test_the_matches_of_one_check_share_one_deadline() -> None:
    """Many matches that each stay under the deadline cannot add up: a check's matches share
    one budget, and what is left of it bounds each (none left: the next match is refused)."""
    validator = compile_schema({"type": "object", "properties": {
        "s": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}}}})
    assert list(validator.iter_errors({"s": ["abc"] * 100})) == []  # each well under 50 ms
    with match_budget(0.0), pytest.raises(TimeoutError):
        list(validator.iter_errors({"s": ["abc"]}))


def test_a_schema_whose_patterns_jsonschema_would_match_without_a_deadline_is_refused() -> None:
    with pytest.raises(InvalidToolSchema, match="unevaluatedProperties beside patternProperties"):
        compile_schema({"type": "object", "allOf": [{"patternProperties": {"^x": {}}}],
                        "unevaluatedProperties": False})
    compile_schema({"type": "object", "unevaluatedProperties": False})  # alone: fine
