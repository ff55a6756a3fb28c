"""The engine boundary: token ids in, token ids + logprobs out.

Every engine (the built-in transformers engine, the SGLang HTTP client, the scripted test
engine) takes a ``GenerateRequest`` and returns a ``GenerateResult``. Nothing else crosses.
These are plain slotted dataclasses rather than pydantic models because thousands of them are
built per second in the rollout hot path; they are validated where they are built.
"""

from __future__ import annotations

import enum
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch only for an annotation: the boundary types must import without it
    import torch

__all__ = ["SamplingParams", "GenerateRequest", "GenerateResult", "FinishReason", "Engine", "REQUEST_PRIORITY"]

# The priority of the requests built in the current asyncio task and the tasks it starts (lower
# first; 0 by default). Asynchronous training sets it per dispatched batch (agent/async_rollout.py),
# so the engine serves the oldest batch's turns first: its groups finish, and the trainer can take
# them, while newer batches fill the engine's spare room (without it, the eta + 1 batches admitted
# at the start share the engine first come first served and the first group ends with the last).
REQUEST_PRIORITY: ContextVar[int] = ContextVar("agentrl_request_priority", default=0)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. Every field is sent explicitly to remote engines."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter (SGLang's convention)
    stop_token_ids: tuple[int, ...] = ()
    # stop strings of any length: generation ends at the token whose decoding completes one
    # (that token is kept in output_ids, as for stop tokens; see ``agentrl.engines.stops``)
    stop: tuple[str, ...] = ()
    seed: int | None = None  # per-request seed; None draws from the engine's generator

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token was sampled, or a stop string completed (the token is included in output_ids)
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # aborted by the caller or the server


@dataclass(slots=True)
class GenerateRequest:
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None  # request id, used to abort
    session_id: str | None = None  # keeps a trajectory's turns on one server (prefix cache)
    # the policy that samples it: "" the main (trained) policy; a trained role's name for the
    # role's own policy (``agentrl.engines.policies.PolicyEngines`` routes by it)
    policy: str = ""
    # the built-in engine admits waiting requests lowest priority first, first come first served
    # within one priority (REQUEST_PRIORITY above: the building task's, unless given)
    priority: int = field(default_factory=REQUEST_PRIORITY.get)


@dataclass(slots=True)
class GenerateResult:
    output_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the sampling policy's weights
    finish_reason: FinishReason
    matched_stop: int | str | None = None  # the stop token id, or the stop string, that ended generation
    prompt_tokens: int = 0
    weight_version: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V the engine reused from an earlier request (prefix cache)
    # the weight version that sampled each output token, when they differ (a request resumed across
    # a weight update); empty: every token was sampled at ``weight_version``
    output_versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError(
                f"output_ids ({len(self.output_ids)}) and logprobs ({len(self.logprobs)}) differ in length"
            )
        if self.output_versions and len(self.output_versions) != len(self.output_ids):
            raise ValueError(
                f"output_ids ({len(self.output_ids)}) and output_versions ({len(self.output_versions)}) differ in length"
            )

    def token_versions(self) -> list[int]:
        """The weight version of every output token."""
        return list(self.output_versions) if self.output_versions else [self.weight_version] * len(self.output_ids)


@runtime_checkable
class Engine(Protocol):
    """What the agent layer needs from an inference engine."""

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def abort(self, rid: str) -> None: ...

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | None = None, *, path: str | None = None, version: int | None = None
    ) -> None:
        """Load new weights from an in-memory state dict or a checkpoint directory."""
        ...

    async def health(self) -> bool: ...
