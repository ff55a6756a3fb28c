"""Tools and interactions at run time: constructed once per worker, instances per trajectory.

``ToolBox`` holds one constructed object per tool (plugins from ``agentrl.tools``) and hands
out a ``ToolSession`` per trajectory. A session creates each enabled tool's instance once,
executes calls (arguments validated against the tool's JSON schema, up to
``max_parallel_calls`` at once, each under a timeout), asks every tool for ``calc_reward`` at
the end and releases every instance ALWAYS - after errors and after cancellation too.

``InteractionPool`` does the same for interactions (``agentrl.interactions``): ``start`` once,
``finalize`` always.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from agentrl.agent.interaction import Interaction, InteractionResponse
from agentrl.agent.tool import Tool, ToolResult
from agentrl.agent.tool_parsers import ParsedCall
from agentrl.agent.verl_yaml import build_interaction, build_tool
from agentrl.config.verl_files import InteractionSpec, ToolSpec
from agentrl.errors import PluginError, ToolError
from agentrl.plugins import PluginRegistry

log = logging.getLogger(__name__)

__all__ = ["ToolBox", "ToolSession", "CallOutcome", "InteractionPool", "InteractionSession", "validate_arguments"]


def validate_arguments(tool: type[Tool] | Tool, arguments: dict[str, Any]) -> str | None:
    """None when ``arguments`` match the tool's JSON schema, else what is wrong (for the model)."""
    return _first_problem(_validator(type(tool) if isinstance(tool, Tool) else tool), tool.name, arguments)


def _first_problem(validator: Any, name: str, arguments: dict[str, Any]) -> str | None:
    if validator.is_valid(arguments):
        return None
    errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
    err = errors[0]
    where = ".".join(str(p) for p in err.path) or "arguments"
    return f"invalid arguments for {name}: {where}: {err.message}"


def schema_problem(name: str, parameters: Any, arguments: dict[str, Any]) -> str | None:
    """None when ``arguments`` match a tool schema given as data (an OpenAI request's
    ``tools[].function.parameters``), else what is wrong; a schema that is not valid JSON Schema
    judges nothing (None)."""
    if not isinstance(parameters, dict):
        return None
    key = json.dumps(parameters, sort_keys=True, default=str)
    validator = _SCHEMA_VALIDATORS.get(key)
    if validator is None:
        import jsonschema  # imported at the first validator built: a run without tool calls never needs it

        try:
            jsonschema.Draft202012Validator.check_schema(parameters)
        except jsonschema.SchemaError:
            return None
        if len(_SCHEMA_VALIDATORS) > 1024:  # schemas a long run's programs send: a bounded cache
            _SCHEMA_VALIDATORS.clear()
        validator = _SCHEMA_VALIDATORS[key] = jsonschema.Draft202012Validator(parameters)
    return _first_problem(validator, name, arguments)


_SCHEMA_VALIDATORS: dict[str, Any] = {}
_VALIDATORS: dict[type, Any] = {}


def _validator(cls: type[Tool]) -> Any:
    if cls not in _VALIDATORS:
        import jsonschema

        schema = cls.parameters
        jsonschema.Draft202012Validator.check_schema(schema)
        _VALIDATORS[cls] = jsonschema.Draft202012Validator(schema)
    return _VALIDATORS[cls]


@dataclass(slots=True)
class CallOutcome:
    call: ParsedCall
    text: str  # what the model is shown
    error: str | None = None  # bad_json | unknown_tool | invalid_arguments | tool_exception | timeout
    reward: float | None = None
    duration_s: float = 0.0
    metrics: dict[str, float] | None = None


class ToolBox:
    """The tools of one worker, each constructed once.

    A row's ``tools_kwargs`` may name a tool the box was not built with: a box that knows its
    plugin registry loads and constructs it then (once, for every later trajectory too); a
    box without one refuses the row with an error naming the tool. Never silently dropped.
    """

    def __init__(
        self,
        tools: dict[str, Tool],
        *,
        max_parallel_calls: int = 4,
        tool_timeout_s: float = 30.0,
        registry: PluginRegistry | None = None,
        tool_config: dict[str, dict[str, Any]] | None = None,
        specs: Sequence[ToolSpec] = (),
    ):
        self.tools = tools
        # the tools a row gets when its tools_kwargs name none (not every tool other rows named)
        self.default_names: list[str] = list(tools)
        self._schemas: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        self.max_parallel_calls = max_parallel_calls
        self.tool_timeout_s = tool_timeout_s
        self._registry = registry
        self._tool_config = tool_config or {}
        # tools defined by a verl tool YAML: their own name and schema, whatever class runs them
        self._specs = {spec.name: spec for spec in specs}
        self._schema_of: dict[str, dict[str, Any]] = {s.name: s.schema for s in specs if s.schema is not None}
        self._validators: dict[str, Any] = {}

    @classmethod
    def from_plugins(
        cls,
        names: list[str],
        tool_config: dict[str, dict[str, Any]] | None = None,
        *,
        registry: PluginRegistry | None = None,
        specs: Sequence[ToolSpec] = (),
        **kwargs: Any,
    ) -> "ToolBox":
        box = cls({}, registry=registry or PluginRegistry(), tool_config=tool_config, specs=specs, **kwargs)
        for name in names:
            box.ensure(name)
        box.default_names = list(names)
        return box

    def ensure(self, name: str) -> Tool:
        """The worker's tool ``name``, loaded and constructed on first use: a tool of the verl
        YAML by that name first, else the plugin."""
        tool = self.tools.get(name)
        if tool is not None:
            return tool
        spec = self._specs.get(name)
        if spec is not None:
            tool = self.tools[name] = build_tool(spec, self._registry or PluginRegistry())
            return tool
        if self._registry is None:
            known = ", ".join(sorted(self.tools)) or "none"
            raise PluginError(f"tools_kwargs names tool {name!r}, which this worker does not have (tools: {known})")
        tool_cls = self._registry.load("tools", name)
        if not (isinstance(tool_cls, type) and issubclass(tool_cls, Tool)):
            raise PluginError(f"tool plugin {name!r} must be a subclass of agentrl.agent.tool.Tool, got {tool_cls!r}")
        tool = self.tools[name] = tool_cls(**self._tool_config.get(name, {}))
        return tool

    def schema_of(self, name: str) -> dict[str, Any]:
        """The function schema the model is offered for tool ``name``."""
        return self._schema_of.get(name) or self.tools[name].schema()

    def parameters_of(self, name: str) -> dict[str, Any]:
        return self.schema_of(name)["function"].get("parameters") or {"type": "object", "properties": {}}

    def validate(self, name: str, arguments: dict[str, Any]) -> str | None:
        """None when ``arguments`` match tool ``name``'s offered schema, else what is wrong."""
        if name not in self._schema_of:
            return validate_arguments(self.tools[name], arguments)
        validator = self._validators.get(name)
        if validator is None:
            import jsonschema

            validator = self._validators[name] = jsonschema.Draft202012Validator(self.parameters_of(name))
        return _first_problem(validator, name, arguments)

    def schemas(self, names: list[str]) -> list[dict[str, Any]]:
        """The tools' function schemas (cached per tool list; do not mutate)."""
        key = tuple(names)
        schemas = self._schemas.get(key)
        if schemas is None:
            schemas = self._schemas[key] = [self.schema_of(n) for n in names if n in self.tools]
        return schemas

    def session(self, instance_id: str, tools_kwargs: dict[str, Any]) -> "ToolSession":
        return ToolSession(self, instance_id, tools_kwargs)


class ToolSession:
    """The tools of one trajectory. Use as ``async with``: release is guaranteed."""

    def __init__(self, box: ToolBox, instance_id: str, tools_kwargs: dict[str, Any]):
        self.box = box
        self.instance_id = instance_id
        # tools enabled for the row: those named in its tools_kwargs, else every tool of the box
        self.enabled = [n for n in tools_kwargs if box.ensure(n)] if tools_kwargs else list(box.default_names)
        self._kwargs = tools_kwargs
        self._created: list[str] = []
        self.calc_rewards: dict[str, float] = {}
        self.calc_reward_errors: dict[str, str] = {}

    def _kw(self, name: str, key: str) -> dict[str, Any]:
        spec = self._kwargs.get(name)
        if spec is None:
            return {}
        value = getattr(spec, key, None) if not isinstance(spec, dict) else spec.get(key)
        return dict(value or {})

    async def __aenter__(self) -> "ToolSession":
        try:
            for name in self.enabled:
                # counted before the call: a create that fails half-way is released too
                self._created.append(name)
                # bounded as a call is (agent.tool_timeout_s): create runs before the trajectory's own timeout
                await _bounded_step(self.box.tools[name].create(self.instance_id, **self._kw(name, "create_kwargs")),
                                    f"tool {name!r}", "create", self.box.tool_timeout_s)
        except BaseException:
            await self._release()
            raise
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self._release()

    async def collect_rewards(self) -> dict[str, float]:
        """Each created tool's ``calc_reward``; a tool that raises is recorded in
        ``calc_reward_errors`` (the trajectory survives it)."""
        for name in self._created:
            try:
                reward = await _bounded_step(  # after the trajectory's timeout: bounded as a call is
                    self.box.tools[name].calc_reward(self.instance_id, **self._kw(name, "calc_reward_kwargs")),
                    f"tool {name!r}", "calc_reward", self.box.tool_timeout_s)
            except Exception as exc:
                self.calc_reward_errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            if reward is not None:
                self.calc_rewards[name] = float(reward)
        return self.calc_rewards

    async def _release(self) -> None:
        # shielded: a cancelled trajectory still releases every instance it created
        created, self._created = self._created, []
        for name in created:
            try:
                await asyncio.shield(self.box.tools[name].release(self.instance_id, **self._kw(name, "release_kwargs")))
            except Exception:
                pass

    def schemas(self) -> list[dict[str, Any]]:
        return self.box.schemas(self.enabled)

    async def execute_all(self, calls: list[ParsedCall]) -> list[CallOutcome]:
        """Run a turn's calls, at most ``max_parallel_calls`` at once; outcomes in call order."""
        if len(calls) == 1:  # the common case, without the cost of tasks
            return [await self.execute(calls[0])]
        if len(calls) <= self.box.max_parallel_calls:
            return list(await asyncio.gather(*(self.execute(c) for c in calls)))
        semaphore = asyncio.Semaphore(self.box.max_parallel_calls)

        async def one(call: ParsedCall) -> CallOutcome:
            async with semaphore:
                return await self.execute(call)

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def execute(self, call: ParsedCall) -> CallOutcome:
        if call.error is not None:
            return CallOutcome(call, f"Error: {call.detail}", error=call.error)
        name = call.name or ""
        if name not in self.enabled:
            known = ", ".join(self.enabled) or "none"
            return CallOutcome(call, f"Error: unknown tool {name!r} (available: {known})", error="unknown_tool")
        tool = self.box.tools[name]
        arguments = _map_plain_input(self.box.parameters_of(name), call.arguments or {})
        problem = self.box.validate(name, arguments)
        if problem is not None:
            return CallOutcome(call, f"Error: {problem}", error="invalid_arguments")
        start = time.perf_counter()
        try:
            result: ToolResult = await _with_timeout(
                tool.execute(self.instance_id, arguments, **self._kw(name, "execute_kwargs")), self.box.tool_timeout_s
            )
        except asyncio.TimeoutError:
            return CallOutcome(
                call, f"Error: {name} timed out after {self.box.tool_timeout_s:g} s", error="timeout",
                duration_s=time.perf_counter() - start,
            )
        except ToolError as exc:
            text = exc.shown if exc.shown is not None else f"Error: {exc}"
            return CallOutcome(call, text, error="tool_exception", duration_s=time.perf_counter() - start)
        except Exception as exc:  # a tool's bug must not end the rollout: the model is told
            return CallOutcome(
                call, f"Error: {name} failed: {type(exc).__name__}: {exc}", error="tool_exception",
                duration_s=time.perf_counter() - start,
            )
        call.arguments = arguments
        return CallOutcome(call, result.text, reward=result.reward, duration_s=time.perf_counter() - start, metrics=result.metrics)


async def _bounded_step(awaitable: Any, who: str, step: str, seconds: float) -> Any:
    """A step outside the trajectory's timeout (a tool's ``create`` or ``calc_reward``, an
    interaction's ``start``, ``calculate_score`` or ``finalize``) within ``agent.tool_timeout_s``;
    past it an error naming ``who`` ("tool 'calculator'") and the step."""
    try:
        return await _with_timeout(awaitable, seconds)
    except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11 on
        raise TimeoutError(f"{who}: {step} did not finish within agent.tool_timeout_s={seconds:g} s") from None


async def _with_timeout(awaitable: Any, seconds: float) -> Any:
    """``await`` under a timeout; ``asyncio.timeout`` (3.11+) needs no extra task per call."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:
        return await asyncio.wait_for(awaitable, seconds)
    async with timeout(seconds):
        return await awaitable


def _map_plain_input(parameters: dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """ReAct's plain-text ``Action Input`` goes to the tool's only required parameter."""
    if set(arguments) != {"__input__"}:
        return arguments
    required = parameters.get("required") or list(parameters.get("properties", {}))
    if len(required) == 1:
        return {required[0]: arguments["__input__"]}
    return arguments


VERL_DEFAULT_INTERACTION = "gsm8k"  # what verl's loops attach to a row whose interaction_kwargs name none


class InteractionPool:
    """The interactions of one worker, by name, each constructed once (lazily)."""

    def __init__(
        self,
        config: dict[str, dict[str, Any]] | None = None,
        registry: PluginRegistry | None = None,
        specs: Sequence[InteractionSpec] = (),
        timeout_s: float = 30.0,
    ):
        self.timeout_s = timeout_s  # each start, calculate_score and finalize (agent.tool_timeout_s)
        self._config = config or {}
        self._registry = registry or PluginRegistry()
        self._instances: dict[str, Interaction] = {}
        self._specs = {spec.name: spec for spec in specs}  # from a verl interaction YAML

    def get(self, name: str) -> Interaction:
        if name not in self._instances and name in self._specs:
            self._instances[name] = build_interaction(self._specs[name], self._registry)
        if name not in self._instances:
            cls = self._registry.load("interactions", name)
            if not (isinstance(cls, type) and issubclass(cls, Interaction)):
                raise PluginError(f"interaction plugin {name!r} must subclass agentrl.agent.interaction.Interaction")
            self._instances[name] = cls(**self._config.get(name, {}))
        return self._instances[name]

    def session(self, instance_id: str, interaction_kwargs: dict[str, Any]) -> "InteractionSession | None":
        """The row's interaction, or None when it names none and no interaction YAML is
        configured (verl attaches an unnamed row's interaction, its default gsm8k, only then)."""
        kwargs = dict(interaction_kwargs)
        name = kwargs.pop("name", None)
        if name is None:
            if not self._specs:
                return None
            name = VERL_DEFAULT_INTERACTION
        return InteractionSession(self.get(name), instance_id, kwargs, name=name, timeout_s=self.timeout_s)


class InteractionSession:
    """One trajectory's interaction: ``start`` on enter, ``finalize`` ALWAYS on exit.

    ``start``, ``calculate_score`` and ``finalize`` run outside the turns that
    ``agent.trajectory_timeout_s`` bounds, so each is bounded as a tool's ``create`` is
    (``agent.tool_timeout_s``); past it a ``TimeoutError`` names the interaction and the step.
    ``generate_response`` runs within the trajectory's turns and its timeout."""

    def __init__(self, interaction: Interaction, instance_id: str, kwargs: dict[str, Any], *, name: str = "",
                 timeout_s: float = 30.0):
        self.interaction, self.instance_id, self.kwargs = interaction, instance_id, kwargs
        self.name, self.timeout_s = name or type(interaction).__name__, timeout_s
        self._started = False

    def _bounded(self, awaitable: Any, step: str) -> Any:
        return _bounded_step(awaitable, f"interaction {self.name!r}", step, self.timeout_s)

    async def __aenter__(self) -> "InteractionSession":
        self._started = True  # before the call: a start that fails half-way is finalized too
        await self._bounded(self.interaction.start(self.instance_id, **self.kwargs), "start")
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self._started:
            self._started = False
            try:
                await asyncio.shield(self._bounded(self.interaction.finalize(self.instance_id), "finalize"))
            except Exception as error:  # the trajectory is done; a failed clean-up must not lose it
                log.warning("%s", error)

    async def respond(self, messages: list[dict[str, Any]]) -> InteractionResponse:
        return await self.interaction.generate_response(self.instance_id, messages)

    async def score(self) -> float | None:
        return await self._bounded(self.interaction.calculate_score(self.instance_id), "calculate_score")
