"""The blocking calls of the code, found by AST (``test_wait_bounds.py``): waits on threads,
processes, queues, events, locks, Ray and subprocesses, and awaits of the seams that reach
another party (an engine's generate and weight update, a tool, an interaction, an environment's
step). A call is bounded in place when it passes a timeout (``timeout=``, ``timeout_s=``, or the
timeout argument of ``wait``/``result``/``acquire``/``join(timeout=)``) or runs inside
``asyncio.wait_for`` or one of the code's own bounding helpers; the others are returned as
``path::function::callee`` for the table of their bounds."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("agentrl", "agent_loops", "tools", "interactions")
# the code's own helpers that put a time limit on what they are given
BOUNDING = ("wait_for", "_with_timeout", "_bounded", "_bounded_sync", "timeout")
# awaited methods that wait on another party (engine, tool, interaction, environment)
SEAMS = frozenset({"generate", "execute", "step", "reset", "update_weights", "weights_changed", "respond", "calc_reward",
                   "create", "release", "generate_response", "calculate_score", "finalize", "open"})
TIMEOUT_KEYWORDS = frozenset({"timeout", "timeout_s"})


def _blocking(node: ast.Call, awaited: bool) -> bool | None:
    """None: not a blocking call; True: bounded in place; False: a wait with no bound of its own."""
    func = node.func
    if not isinstance(func, ast.Attribute):
        return None
    name, base, args = func.attr, ast.unparse(func.value), len(node.args)
    keywords = {k.arg for k in node.keywords}
    timeout = bool(keywords & TIMEOUT_KEYWORDS)
    if awaited and name in SEAMS:
        return timeout
    if base == "ray" and name in ("get", "wait"):
        return timeout
    if base == "subprocess" and name in ("run", "check_output", "check_call", "call"):
        return timeout
    if base == "asyncio" and name == "wait":
        return timeout
    if name == "get" and (args == 0 or "block" in keywords) and base not in ("_CURRENT",):  # a queue's get
        return timeout
    if name == "join" and args == 0:  # a thread's or process's (str.join takes one argument)
        return timeout
    if name in ("wait", "result", "acquire") and base != "asyncio":
        return timeout or args > 0
    if name in ("communicate", "recv", "urlopen"):
        return timeout
    return None


def unbounded_calls() -> dict[str, int]:
    """``path::function::callee`` -> line, of every blocking call without a bound in place."""
    found: dict[str, int] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text())
            parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
            for function in ast.walk(tree):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if not isinstance(node, ast.Call):
                        continue
                    bounded = _blocking(node, isinstance(parents.get(node), ast.Await))
                    if bounded is None or bounded or _inside_bound(node, parents, function):
                        continue
                    key = f"{path.relative_to(REPO)}::{function.name}::{ast.unparse(node.func)}"
                    found.setdefault(key, node.lineno)
    return found


def _inside_bound(node: ast.AST, parents: dict[ast.AST, ast.AST], function: ast.AST) -> bool:
    """Whether ``node`` is an argument (at any depth) of a bounding call, or inside ``async with
    asyncio.timeout(...)``, within its function."""
    while node is not function and node in parents:
        node = parents[node]
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in BOUNDING:
            return True
        if isinstance(node, ast.AsyncWith) and any("timeout" in ast.unparse(item.context_expr) for item in node.items):
            return True
    return False
