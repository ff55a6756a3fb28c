"""TRL environment classes (``GRPOTrainer(environment_factory=Cls)``, TRL 1.16) run unchanged.

What TRL's trainer does with such a class, and what agentrl does here (the ``trl_env`` loop):

* one instance per rollout: ``Cls()`` (TRL pools instances and resets them; agentrl makes one per
  trajectory, ``Cls(**args)`` with the ref's ``args``, empty as in TRL by default);
* ``reset(**row)`` with the dataset row's columns (TRL: every column, ``prompt`` included);
  here ``prompt`` (the row's messages) and every top-level column that agentrl's row schema
  does not define (``answer``, ``task_id``, ...), as a TRL dataset holds them (``reset_kwargs``);
* what ``reset`` returns, when not None, is appended to the last prompt message's content;
* the class's public functions (``inspect.getmembers(type(env), inspect.isfunction)``, minus
  ``reset``, ``get_reward`` and names starting with ``_``), in name order, are the model's tools,
  their schemas ``transformers.utils.get_json_schema`` of the bound method, exactly what TRL
  hands the chat template; a result is shown as ``str(result)``, a method that raises as
  ``str({'error': str(exc)})`` (counted as a tool error, not a crash);
* reward functions are called as TRL calls ``reward_funcs``: ``fn(prompts=, completions=,
  completion_ids=, environments=, trainer_state=, log_extra=, log_metric=, **columns)``, each
  argument a list over a group (``score_group``: the ``n`` samples of a row, once all have
  finished, so a function that ranks or normalises within its batch sees the group; TRL's batch
  is a process's generation batch, one or more whole groups); ``None`` is "no score" (ignored in
  the weighted sum, as TRL's nansum); a class with ``get_reward`` adds it as one more function of
  weight 1 named after the class. Each function's value is the metric ``env/<name>``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

from agentrl.agent.tool import Tool, ToolResult
from agentrl.agent.tools_runtime import ToolBox
from agentrl.config.schema import TrlEnvironmentConfig
from agentrl.data.row import Row
from agentrl.environments.spec import EnvironmentRef, resolve
from agentrl.errors import PluginError, ToolError
from agentrl.plugins import PluginRegistry

__all__ = ["TRL_VERSION", "environment_class", "tool_names", "tool_schema", "reset_kwargs", "first_prompt", "tool_box",
           "RewardFunction", "reward_functions", "Completion", "score_group"]

TRL_VERSION = "1.16"  # the TRL whose GRPOTrainer semantics this module follows (extra trl-env)
_SKIPPED = ("reset", "get_reward")
_lock = threading.Lock()
_tool_classes: dict[tuple[type, str], type["_MethodTool"]] = {}
_reward_cache: dict[tuple[str, ...], list["RewardFunction"]] = {}


def environment_class(ref: EnvironmentRef, registry: PluginRegistry | None = None) -> Any:
    """The class (or factory) ``ref.name`` names; like TRL it must define a callable ``reset``."""
    factory = resolve(ref, registry)
    if not callable(factory):
        raise PluginError(f"trl environment {ref.name!r} is {type(factory).__name__}, not a class: name the environment "
                          "class (pkg.mod:Class), as GRPOTrainer(environment_factory=Class) takes it")
    if isinstance(factory, type) and not callable(getattr(factory, "reset", None)):
        raise PluginError(f"trl environment {ref.name!r} ({factory.__qualname__}) defines no reset method; TRL requires one")
    return factory


def tool_names(env_type: type) -> list[str]:
    """The methods TRL offers as tools: public functions of the class, by name, minus reset/get_reward."""
    return [name for name, _ in inspect.getmembers(env_type, predicate=inspect.isfunction)
            if name not in _SKIPPED and not name.startswith("_")]


def tool_schema(method: Callable[..., Any]) -> dict[str, Any]:
    """The schema transformers (and so TRL) renders for a tool method: ``get_json_schema``."""
    from transformers.utils.chat_template_utils import get_json_schema

    try:
        return dict(get_json_schema(method))
    except Exception as exc:  # a missing docstring or type hint: transformers' own message says which
        owner = getattr(method, "__qualname__", repr(method))
        raise PluginError(f"trl environment tool {owner} has no schema transformers can build: {type(exc).__name__}: {exc}") from exc


def reset_kwargs(row: Row) -> dict[str, Any]:
    """What ``reset(**row)`` receives: ``prompt`` (the row's messages) and the row's own columns
    (the top-level ones agentrl's schema does not define), as a TRL dataset row holds them."""
    return {"prompt": row.messages(), **(row.model_extra or {})}


def first_prompt(messages: list[dict[str, Any]], observation: Any) -> list[dict[str, Any]]:
    """TRL's prompt after ``reset``: the observation appended to the last message's content."""
    if observation is None:
        return messages
    content = messages[-1]["content"]
    if not isinstance(observation, str):
        raise TypeError(f"reset returned {type(observation).__name__}; agentrl takes a text observation (or None)")
    return messages[:-1] + [{**messages[-1], "content": content + observation}]


def _tool_class(env_type: type, name: str, method: Callable[..., Any]) -> type["_MethodTool"]:
    """The tool class of one method of a class, its schema built once per process."""
    key = (env_type, name)
    with _lock:
        cls = _tool_classes.get(key)
    if cls is None:
        schema = tool_schema(method)
        function = schema["function"]
        attrs = {"name": name, "description": function.get("description", ""), "full_schema": schema,
                 "parameters": function.get("parameters") or {"type": "object", "properties": {}}}
        made: type[_MethodTool] = type(f"{env_type.__name__}_{name}", (_MethodTool,), attrs)
        with _lock:
            cls = _tool_classes.setdefault(key, made)
    return cls


class _MethodTool(Tool):
    """One public method of one environment instance, as an agentrl tool (one trajectory's)."""

    full_schema: dict[str, Any]

    def __init__(self, method: Callable[..., Any], serial: asyncio.Lock):
        super().__init__()
        self.method, self.serial = method, serial

    @classmethod
    def schema(cls) -> dict[str, Any]:
        return cls.full_schema

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        try:
            if inspect.iscoroutinefunction(self.method):
                result = await self.method(**arguments)
            else:  # TRL calls an instance's sync tools one after another; off the event loop here
                async with self.serial:
                    result = await asyncio.to_thread(self.method, **arguments)
        except Exception as exc:  # TRL: {"error": str(e)}, shown to the model, counted as a failure
            raise ToolError(f"{self.name} raised {type(exc).__name__}: {exc}", shown=str({"error": str(exc)})) from exc
        return ToolResult(text=_tool_text(result))


def _tool_text(result: Any) -> str:
    if isinstance(result, list):  # TRL passes content blocks through; agentrl renders their text
        return "".join(part.get("text", "") for part in result if isinstance(part, dict) and part.get("type") == "text")
    return str(result)


def tool_box(env: Any, *, max_parallel_calls: int, tool_timeout_s: float) -> ToolBox:
    """A trajectory's tools: the instance's public methods, each with TRL's schema."""
    env_type, serial = type(env), asyncio.Lock()
    tools: dict[str, Tool] = {}
    for name in tool_names(env_type):
        method = getattr(env, name)
        tools[name] = _tool_class(env_type, name, method)(method, serial)
    return ToolBox(tools, max_parallel_calls=max_parallel_calls, tool_timeout_s=tool_timeout_s)


@dataclass(frozen=True, slots=True)
class RewardFunction:
    name: str  # the metric env/<name>: the function's __name__ (TRL's reward_func_names), a get_reward's class name
    fn: Callable[..., Any]
    weight: float
    env_type: type | None = None  # a class's get_reward: scores that class's trajectories only


def reward_functions(config: TrlEnvironmentConfig, env_type: type | None, registry: PluginRegistry | None = None) -> list[RewardFunction]:
    """``environment.trl.reward_funcs`` with their weights, then the class's ``get_reward`` (weight 1)."""
    key = (*config.reward_funcs, repr(config.reward_weights), repr(env_type))
    with _lock:
        if key in _reward_cache:
            return _reward_cache[key]
    registry = registry or PluginRegistry()
    weights = config.reward_weights if config.reward_weights is not None else [1.0] * len(config.reward_funcs)
    funcs = []
    for target, weight in zip(config.reward_funcs, weights):
        try:
            fn = registry.load_object("environments", target)
        except PluginError as exc:
            raise PluginError(f"environment.trl.reward_funcs: {exc}") from exc
        funcs.append(RewardFunction(getattr(fn, "__name__", target), fn, float(weight)))
    if env_type is not None and callable(getattr(env_type, "get_reward", None)):
        funcs.append(RewardFunction(env_type.__name__, _get_reward(env_type), 1.0, env_type))
    with _lock:
        return _reward_cache.setdefault(key, funcs)


def _get_reward(env_type: Any) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(env_type.get_reward):
        async def get_reward(environments: list[Any], **kwargs: Any) -> list[Any]:  # TRL's wrapper
            return [await e.get_reward() if type(e) is env_type else None for e in environments]
        return get_reward

    def get_reward_sync(environments: list[Any], **kwargs: Any) -> list[Any]:
        return [e.get_reward() if type(e) is env_type else None for e in environments]
    return get_reward_sync


@dataclass(frozen=True, slots=True)
class Completion:
    """One trajectory's place in a reward call: what TRL puts at its index of each list."""

    prompt: list[dict[str, Any]]  # the prompt messages after reset (prompts[i])
    completion: list[dict[str, Any]]  # the messages after the prompt (completions[i])
    completion_ids: list[int]  # the response's token ids (completion_ids[i])
    env: Any  # the trajectory's environment instance (environments[i])
    columns: dict[str, Any]  # reset_kwargs of its row: each column's value at index i


async def score_group(funcs: list[RewardFunction], members: list[Completion], *,
                      global_step: int) -> list[tuple[float | None, dict[str, float]]]:
    """TRL's ``_calculate_rewards`` over ``members`` (a group: the ``n`` samples of a row): each
    function called once with every argument a list over the members, in their order. Per member,
    the weighted sum of its scores (None: every function said None) and each function's score by
    name (those that gave one); a value a function logs with ``log_metric`` goes to every member
    as ``metric/<name>``. A function that raises, or returns a list of another length, propagates."""
    if not members:
        return []
    n = len(members)
    logged: dict[str, float] = {}
    keys = [k for k in members[0].columns if k not in ("prompt", "completion", "completion_ids")]
    kwargs: dict[str, Any] = {k: [m.columns[k] for m in members] for k in keys}
    kwargs.update(trainer_state=types.SimpleNamespace(global_step=global_step), environments=[m.env for m in members],
                  log_extra=lambda column, values: None, log_metric=lambda name, value: logged.__setitem__(name, float(value)))
    totals = [0.0] * n
    values: list[dict[str, float]] = [{} for _ in range(n)]
    for f in funcs:
        call = f.fn(prompts=[m.prompt for m in members], completions=[m.completion for m in members],
                    completion_ids=[m.completion_ids for m in members], **kwargs)
        out = await call if inspect.isawaitable(call) else call
        if len(out) != n:
            raise ValueError(f"reward function {f.name!r} returned {len(out)} rewards for {n} completions")
        for i, value in enumerate(out):
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            values[i][f.name] = float(value)
            totals[i] += f.weight * float(value)
    metrics = {f"metric/{k}": v for k, v in logged.items()}
    return [((total if own else None), {**own, **metrics}) for total, own in zip(totals, values)]

