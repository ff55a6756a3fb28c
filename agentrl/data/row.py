"""The dataset row: verl's parquet schema, validated with pydantic on load.

A row is one prompt plus everything the agent layer needs to run and score it: the chat
messages, the ground truth for the reward, per-tool create kwargs, the interaction to attach
and, optionally, which agent loop runs it, or the environment (a verifiers environment, an
OpenEnv server, a TRL environment class) that it belongs to (``extra_info.environment``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentrl.config.schema import ENVIRONMENT_EXTRAS, ENVIRONMENT_LOOPS, EnvironmentConfig, EnvironmentLibrary

__all__ = ["Message", "RewardModelSpec", "InteractionKwargs", "ToolKwargs", "EnvironmentRef", "ENVIRONMENT_LOOPS",
           "ENVIRONMENT_EXTRAS", "ExtraInfo", "Row"]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None


class RewardModelSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    style: str = "rule"
    ground_truth: str | None = None

    @field_validator("ground_truth", mode="before")
    @classmethod
    def _stringify(cls, value: Any) -> Any:
        # verl datasets sometimes store numeric ground truths; the reward compares text.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        return value


class ToolKwargs(BaseModel):
    model_config = ConfigDict(extra="allow")

    create_kwargs: dict[str, Any] = Field(default_factory=dict)
    execute_kwargs: dict[str, Any] = Field(default_factory=dict)
    calc_reward_kwargs: dict[str, Any] = Field(default_factory=dict)
    release_kwargs: dict[str, Any] = Field(default_factory=dict)


class InteractionKwargs(BaseModel):
    model_config = ConfigDict(extra="allow")

    # verl's rows may leave the name out (its tool variant carries interaction_kwargs without
    # one): such a row gets an interaction only when an interaction YAML is configured, as in
    # verl, and then verl's default, gsm8k (see InteractionPool.session)
    name: str | None = None


class EnvironmentRef(BaseModel):
    """Which environment a row belongs to: ``extra_info.environment`` of a row, else the config's
    ``environment`` section. ``name`` is an entry point in group ``agentrl.environments``, a
    module ``pkg.mod`` or ``pkg.mod:attr`` (``agentrl.environments.spec.resolve``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    library: EnvironmentLibrary
    name: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("args", mode="before")
    @classmethod
    def _null_args(cls, value: Any) -> Any:
        return {} if value is None else value

    @property
    def loop(self) -> str:
        """The agent loop that runs this library's rows."""
        return ENVIRONMENT_LOOPS[self.library]

    @property
    def extra(self) -> str:
        """agentrl's optional-dependency extra that installs the library."""
        return ENVIRONMENT_EXTRAS[self.library]

    @classmethod
    def from_config(cls, config: EnvironmentConfig) -> "EnvironmentRef | None":
        """The config section's ref, or None when it names no library."""
        if config.library is None:
            return None
        return cls(library=config.library, name=config.name, args=dict(config.args))


class ExtraInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int | None = None
    split: str | None = None
    tools_kwargs: dict[str, ToolKwargs] = Field(default_factory=dict)
    interaction_kwargs: InteractionKwargs | None = None
    environment: EnvironmentRef | None = None  # the row's environment (wins over the config's)

    @field_validator("tools_kwargs", "interaction_kwargs", "environment", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any, info: Any) -> Any:
        # parquet writers turn absent structs into {} or None; both mean "not set".
        if value in (None, {}):
            return {} if info.field_name == "tools_kwargs" else None
        return value


class Row(BaseModel):
    """One training or evaluation example (verl-compatible)."""

    model_config = ConfigDict(extra="allow")

    data_source: str
    prompt: list[Message] = Field(min_length=1)
    ability: str | None = None
    reward_model: RewardModelSpec = Field(default_factory=RewardModelSpec)
    extra_info: ExtraInfo = Field(default_factory=ExtraInfo)
    agent_name: str | None = None

    @property
    def ground_truth(self) -> str | None:
        return self.reward_model.ground_truth

    def environment_ref(self, default: EnvironmentRef | None = None) -> EnvironmentRef | None:
        """The row's environment ref (``extra_info.environment``), else ``default`` (the config's).
        A row's ref that names no environment takes ``default``'s name when both are of one
        library (the row's args stay its own: its arguments to the config's environment)."""
        own = self.extra_info.environment
        if own is None:
            return default
        if own.name is None and default is not None and default.library == own.library:
            return own.model_copy(update={"name": default.name})
        return own

    def loop_name(self, default: EnvironmentRef | None = None) -> str | None:
        """The loop this row asks for: its ``agent_name``, else its environment's library loop,
        else None (the configured default loop)."""
        if self.agent_name is not None:
            return self.agent_name
        ref = self.environment_ref(default)
        return ref.loop if ref is not None else None

    def messages(self) -> list[dict[str, Any]]:
        """The prompt as plain dicts, the form chat templates take."""
        return [m.model_dump(exclude_none=True) for m in self.prompt]
