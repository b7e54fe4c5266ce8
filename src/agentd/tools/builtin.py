"""Built-in tools: `clock` (database time) and `calculator` (safe arithmetic, no eval)."""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from agentd.queries import Q
from agentd.tools.registry import Tool, ToolContext, ToolError

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000


def evaluate(expression: str) -> float | int:
    """Arithmetic on numbers only: + - * / // % ** and parentheses."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None

    def walk(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ToolError("exponent too large")
            try:
                return _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        raise ToolError(f"unsupported element in expression: {type(node).__name__}")

    result = walk(tree)
    if isinstance(result, float) and not math.isfinite(result):
        raise ToolError("result is not a finite number")
    return result


async def _clock(_args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    now = await ctx.db.fetchval(Q["database_clock"])
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
