"""Built-in tools: `clock` (database time) and `calculator` (safe arithmetic, no eval)."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from agentd.tools.registry import Tool, ToolContext, ToolError

Number = float | int
_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000
_MAX_INT_BITS = 4096  # ~1,233 digits: big enough for arithmetic, too small to stall the worker


def _check_size(value: float | int) -> float | int:
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise ToolError("number too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    return value


def _power(left: float | int, right: float | int) -> float | int:
    # Refuse before computing: 10 ** 1000 ** 1000 must never be attempted.
    if abs(right) > _MAX_EXPONENT:
        raise ToolError("exponent too large")
    if isinstance(left, int) and isinstance(right, int) and right > 0 and \
            abs(left).bit_length() * right > _MAX_INT_BITS + right:
        raise ToolError("number too large")
    return left ** right


def evaluate(expression: str) -> float | int:
    """Arithmetic on numbers only: + - * / // % ** and parentheses. Never eval: the parsed
    tree is walked and anything but a number or one of these operators is refused."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError(f"not an arithmetic expression: {expression[:100]!r}") from None

    def walk(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return _check_size(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            try:
                if isinstance(node.op, ast.Pow):
                    return _check_size(_power(left, right))
                return _check_size(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("number too large") from None
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        raise ToolError(f"unsupported element in expression: {type(node).__name__}")

    try:
        return walk(tree)
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


async def _clock(_args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    now = await ctx.store.database_time()
    return {"utc": now.isoformat()}


async def _calculator(args: dict[str, Any], _ctx: ToolContext) -> dict[str, Any]:
    return {"expression": args["expression"], "value": evaluate(args["expression"])}


def clock_tool() -> Tool:
    return Tool("clock", "The current UTC time, from the database clock.",
                {"type": "object", "properties": {}, "additionalProperties": False}, _clock)


def calculator_tool() -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression (+ - * / // % ** and parens).",
                {"type": "object", "properties": {"expression": {"type": "string",
                                                                 "maxLength": 500}},
                 "required": ["expression"], "additionalProperties": False}, _calculator)
