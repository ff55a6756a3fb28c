"""``calculator``: evaluates an arithmetic expression safely (no names, no calls, bounded size)."""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from agentrl.agent.tool import Tool, ToolResult
from agentrl.errors import ToolError

__all__ = ["CalculatorTool", "evaluate"]

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_ABS = 10**18
MAX_EXPONENT = 64


def evaluate(expression: str) -> int | float:
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if isinstance(value, complex) or (isinstance(value, (int, float)) and abs(value) > MAX_ABS):
            raise ToolError("result out of range")
        return value
    raise ToolError(f"unsupported expression element: {type(node).__name__} (only numbers and + - * / // % ** are allowed)")


def format_number(value: int | float) -> str:
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value):
            return str(int(value))
        return f"{value:.6f}".rstrip("0").rstrip(".")
    return str(value)


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example 4821 * 37"}},
        "required": ["expression"],
    }

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        return ToolResult(text=format_number(evaluate(arguments["expression"])))
