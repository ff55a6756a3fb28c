"""The dataset row: verl's parquet schema, validated with pydantic on load.

A row is one prompt plus everything the agent layer needs to run and score it: the chat
messages, the ground truth for the reward, per-tool create kwargs, the interaction to attach
and, optionally, which agent loop runs it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["Message", "RewardModelSpec", "InteractionKwargs", "ToolKwargs", "ExtraInfo", "Row"]


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


class ExtraInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int | None = None
    split: str | None = None
    tools_kwargs: dict[str, ToolKwargs] = Field(default_factory=dict)
    interaction_kwargs: InteractionKwargs | None = None

    @field_validator("tools_kwargs", "interaction_kwargs", mode="before")
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

    def messages(self) -> list[dict[str, Any]]:
        """The prompt as plain dicts, the form chat templates take."""
        return [m.model_dump(exclude_none=True) for m in self.prompt]
