"""The parse rate of a run: what the parser made of each assistant turn.

Per trajectory (``Trajectory.metrics``, counted as each turn is read):

* ``tool_calls/parsed``: calls read whole - a name the session offers and arguments its schema accepts;
* ``tool_calls/malformed/<kind>``: the others, by kind (``bad_json``: the format could not be
  read; ``unknown_tool``; ``invalid_arguments``);
* ``tool_calls/unparsed_turns``: turns that hold the parser's ``call_marker`` but yielded no
  call at all (an attempt the format did not recognise: a model whose calls are never read
  learns nothing from its tools).

Per step (``step_metrics``): their sums, ``tool_calls/malformed_rate`` (malformed / all calls,
0 with no calls) and ``tool_calls/unparsed_turn_rate`` (unparsed turns / assistant turns).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from agentrl.agent.tool_parsers import ParsedCall, ParsedTurn, parse_turn
from agentrl.agent.tools_runtime import schema_problem

__all__ = ["PARSED", "MALFORMED", "UNPARSED_TURNS", "malformed_kind", "count_turn", "read_turn", "step_metrics", "describe"]

PARSED = "tool_calls/parsed"
MALFORMED = "tool_calls/malformed/"  # + the kind
UNPARSED_TURNS = "tool_calls/unparsed_turns"


def malformed_kind(call: ParsedCall, tools: Sequence[dict[str, Any]]) -> str | None:
    """Why ``call`` cannot run as written (None: it can), judged as ``ToolSession.execute`` judges it."""
    if call.error is not None:
        return call.error
    functions = {f.get("name"): f for f in (t.get("function", t) for t in tools if isinstance(t, dict)) if isinstance(f, dict)}
    if call.name not in functions:
        return "unknown_tool"
    arguments = call.arguments or {}
    if "__input__" in arguments:  # ReAct's plain input: the session gives it to the tool's only required parameter
        return None
    return "invalid_arguments" if schema_problem(str(call.name), functions[call.name].get("parameters"), arguments) else None


def count_turn(counts: Counter[str], parser: Any, text: str, parsed: ParsedTurn, tools: Sequence[dict[str, Any]]) -> None:
    """Add one assistant turn's calls to ``counts`` (the trajectory's metric counters)."""
    for call in parsed.calls:
        kind = malformed_kind(call, tools)
        counts[PARSED if kind is None else MALFORMED + kind] += 1
    marker = getattr(parser, "call_marker", None)
    if not parsed.calls and marker and marker in text:
        counts[UNPARSED_TURNS] += 1


def read_turn(parser: Any, text: str, tools: Sequence[dict[str, Any]], counts: Counter[str]) -> ParsedTurn:
    """Parse an assistant turn with the session's tool schemas and count what came of it."""
    parsed = parse_turn(parser, text, tools)
    count_turn(counts, parser, text, parsed, tools)
    return parsed


def step_metrics(trajectories: Sequence[Any], prefix: str = "") -> dict[str, float]:
    """The step's parse rate from its trajectories' counts (``Trajectory.metrics``)."""
    sums: dict[str, float] = {PARSED: 0.0, UNPARSED_TURNS: 0.0}
    turns = 0.0
    for t in trajectories:
        turns += t.metrics.get("turns", 0.0)
        for key, value in t.metrics.items():
            if key in (PARSED, UNPARSED_TURNS) or key.startswith(MALFORMED):
                sums[key] = sums.get(key, 0.0) + value
    malformed = sum(v for k, v in sums.items() if k.startswith(MALFORMED))
    calls = sums[PARSED] + malformed
    m = {f"{prefix}{k}": v for k, v in sums.items()}
    m[f"{prefix}tool_calls/malformed_rate"] = malformed / calls if calls else 0.0
    m[f"{prefix}tool_calls/unparsed_turn_rate"] = sums[UNPARSED_TURNS] / turns if turns else 0.0
    return m


def describe(metrics: dict[str, float]) -> str | None:
    """One line for people (``agentrl replay show``): the calls parsed and malformed by kind, and
    the turns that attempted a call the parser did not read; None when nothing was counted."""
    malformed = {k[len(MALFORMED) :]: int(v) for k, v in sorted(metrics.items()) if k.startswith(MALFORMED) and v}
    parsed, unparsed = int(metrics.get(PARSED, 0)), int(metrics.get(UNPARSED_TURNS, 0))
    if not (parsed or malformed or unparsed):
        return None
    kinds = f" ({', '.join(f'{kind} {n}' for kind, n in malformed.items())})" if malformed else ""
    return (f"tool calls: {parsed} parsed, {sum(malformed.values())} malformed{kinds}; {unparsed} of "
            f"{int(metrics.get('turns', 0))} assistant turns with a call marker and no call read")
