"""``calculator``: evaluates an arithmetic expression safely.

The expression is parsed with :mod:`ast` and walked by hand: numbers, ``+ - * / // % **``,
unary signs and parentheses, nothing else (no names, no calls, no attributes), so a model
cannot reach Python through it. Work is bounded: at most ``MAX_CHARS`` characters, exponents
of at most ``MAX_EXPONENT`` and every number (literal or intermediate) within ``MAX_ABS``.
``^`` and ``×`` are read as ``**`` and ``*`` because models write them.

Results are text: integers and integral floats without a fraction (``48/2`` -> ``24``),
other floats rounded to 6 decimals with trailing zeros dropped (``1/3`` -> ``0.333333``),
numbers too small for that in 6 significant digits (``1e-9`` -> ``1e-09``). Every problem is a
:class:`~agentrl.errors.ToolError` whose message is what the model is shown.

A tool-latency knob for benchmarks (``agent.tool_config.calculator``): ``latency_median_s`` > 0
makes every call wait a lognormal time with that median and ``latency_p99_s`` as its 99th
percentile, drawn from ``latency_seed``, the trajectory's instance id and the call's index, so
two runs of the same data wait the same times (``agentrl bench async``).

Every calculator annotation of the GSM8K training file (23,716) evaluates to its annotated
value (``tests/agent/test_tools_builtin.py``).
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
import random
import zlib
from collections import Counter
from typing import Any, Callable

from agentrl.agent.tool import Tool, ToolResult
from agentrl.errors import ToolError

__all__ = ["CalculatorTool", "evaluate", "format_number", "MAX_ABS", "MAX_EXPONENT", "MAX_CHARS"]

MAX_ABS = 10**18  # largest magnitude of any number along the way
MAX_EXPONENT = 64  # largest |exponent| of **
MAX_CHARS = 500  # longest expression accepted (bounds parse time and recursion depth)

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ``ToolError`` says why there is none."""
    text = expression.strip().replace("^", "**").replace("×", "*")
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_CHARS:
        raise ToolError(f"expression too long ({len(text)} characters, at most {MAX_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        shown = expression if len(expression) <= 60 else expression[:57] + "..."
        raise ToolError(f"cannot parse {shown!r}: {exc.msg}") from None
    try:
        return _eval(tree.body)
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolError(f"only numbers are allowed, not {value!r}")
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {format_number(right)} is too large (at most {MAX_EXPONENT})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"result out of range (larger than {MAX_ABS:.0e})") from None
        if isinstance(value, complex):
            raise ToolError("the result is not a real number")
        return _checked(value)
    raise ToolError(_refusal(node))


def _checked(value: int | float) -> int | float:
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_ABS:
        raise ToolError(f"result out of range (larger than {MAX_ABS:.0e})")
    return value


def _refusal(node: ast.AST) -> str:
    """Why ``node`` is not arithmetic, in words the model can act on."""
    allowed = "only numbers, + - * / // % ** and parentheses are allowed"
    if isinstance(node, ast.Name):
        return f"unknown name {node.id!r}: {allowed}"
    if isinstance(node, ast.Call):
        return f"function calls are not allowed: {allowed}"
    if isinstance(node, ast.Tuple):
        return f"commas are not allowed (write 1000, not 1,000): {allowed}"
    return f"unsupported {type(node).__name__}: {allowed}"


def format_number(value: int | float) -> str:
    """Integers as they are, floats to 6 decimals without trailing zeros."""
    if isinstance(value, int):
        return str(value)
    if value == int(value):
        return str(int(value))
    if abs(value) < 1e-6:
        return f"{value:.6g}"
    return f"{value:.6f}".rstrip("0").rstrip(".")


class CalculatorTool(Tool):
    """Evaluates one arithmetic expression per call.

    A row may make each call a checked step: ``create_kwargs`` ``{"expected_steps": [values],
    "step_reward": r}`` gives a call whose value is one of the expected intermediate values (each
    counted once) the step reward ``r`` on its turn, and any other call 0 (the ``word_steps``
    task: turn-level credit). Without them a call carries no reward."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "the expression to evaluate, for example 4821 * 37"},
        },
        "required": ["expression"],
    }

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self._steps: dict[str, tuple[list[float], float]] = {}  # instance -> (values not yet reached, reward)
        self.latency_median_s = float(config.get("latency_median_s", 0.0))
        self.latency_p99_s = float(config.get("latency_p99_s", self.latency_median_s))
        if self.latency_median_s < 0 or self.latency_p99_s < self.latency_median_s:
            raise ValueError(f"calculator: latency_median_s ({self.latency_median_s}) must be >= 0 and latency_p99_s "
                             f"({self.latency_p99_s}) at least the median")
        self.latency_seed = int(config.get("latency_seed", 0))
        self._calls: Counter[str] = Counter()

    def latency_s(self, instance_id: str, call: int) -> float:
        """The wait of call ``call`` of ``instance_id``: lognormal, median and 99th percentile as configured."""
        if self.latency_median_s == 0:
            return 0.0
        sigma = math.log(self.latency_p99_s / self.latency_median_s) / 2.3263478740408408  # z of the 99th percentile
        rng = random.Random(zlib.crc32(f"{self.latency_seed}|{instance_id}|{call}".encode()))
        return rng.lognormvariate(math.log(self.latency_median_s), sigma)

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:
        expected = create_kwargs.get("expected_steps")
        if expected:
            self._steps[instance_id] = ([float(v) for v in expected], float(create_kwargs.get("step_reward", 1.0)))

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        if self.latency_median_s:
            self._calls[instance_id] += 1
            await asyncio.sleep(self.latency_s(instance_id, self._calls[instance_id]))
        value = evaluate(arguments["expression"])
        steps = self._steps.get(instance_id)
        if steps is None:
            return ToolResult(text=format_number(value))
        remaining, reward = steps
        hit = next((i for i, v in enumerate(remaining) if abs(v - value) < 1e-9), None)
        if hit is not None:
            remaining.pop(hit)
        return ToolResult(text=format_number(value), reward=reward if hit is not None else 0.0)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._steps.pop(instance_id, None)
        self._calls.pop(instance_id, None)
