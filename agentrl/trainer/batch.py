"""The training batch: trajectories as padded tensors, built by ONE converter.

Layout (verl's, chosen so that every response starts in the same column):

    input_ids  | pad pad p0 p1 p2 | r0 r1 r2 r3 pad |      (B, P + R)
                 <-- prompt P --->  <-- response R ->
               left-padded prompt   right-padded response

The logits at column ``P - 1 + t`` predict response token ``t``, so the response logprobs of
the whole batch are one slice ``logits[:, P - 1 : P + R - 1]``, and the same slice of a value
head's output is the value of the state before each response token.

Response tokens are of two kinds (``Trajectory.response_mask``): *sampled* by the policy
(``response_mask`` 1, trained on) and *observed* (tool results, user turns: attended to but
masked out of every loss). Padding is neither (``attention_mask`` 0).

Rewards sit on tokens: each assistant turn's reward on the last token of that turn, the
trajectory reward on the last sampled token of the response. ``turn_ids`` numbers the
assistant turns so the critic-free estimators can give each turn its own return.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from agentrl.errors import TrajectoryError
from agentrl.trajectory import Trajectory

__all__ = ["TrainBatch", "collate", "collate_sequences"]

# Fields filled in by the training step after the rollout (None until then).
_STEP_FIELDS = ("old_logprobs", "ref_logprobs", "values", "advantages", "returns")


@dataclass(slots=True)
class TrainBatch:
    """Padded tensors for B trajectories; P prompt columns, R response columns, K turns."""

    input_ids: torch.Tensor  # (B, P+R) long: left-padded prompt, right-padded response
    attention_mask: torch.Tensor  # (B, P+R) long: 1 on prompt, sampled and observed tokens
    position_ids: torch.Tensor  # (B, P+R) long: 0 at the first real token of each row
    response_mask: torch.Tensor  # (B, R) float: 1 on sampled tokens (the loss mask)
    engine_logprobs: torch.Tensor  # (B, R) float: the engine's logprob of each sampled token, 0 elsewhere
    token_rewards: torch.Tensor  # (B, R) float: turn rewards + trajectory reward on their tokens
    turn_ids: torch.Tensor  # (B, R) long: assistant-turn index 0..K-1 of sampled tokens, -1 elsewhere
    turn_rewards: torch.Tensor  # (B, K) float: reward of assistant turn k (trajectory reward added to the last)
    num_turns: torch.Tensor  # (B,) long: assistant turns per trajectory
    group_index: torch.Tensor  # (B,) long: GRPO/RLOO group (the n samples of one prompt)
    scores: torch.Tensor  # (B,) float: the trajectory reward
    old_logprobs: torch.Tensor | None = None  # (B, R) the trainer's logprobs before the update
    ref_logprobs: torch.Tensor | None = None  # (B, R) the reference policy's logprobs
    values: torch.Tensor | None = None  # (B, R) the critic's values before the update
    advantages: torch.Tensor | None = None  # (B, R)
    returns: torch.Tensor | None = None  # (B, R) value targets
    # (B,) long: the row of the trajectory each row trains, when some have earlier segments
    # (``step.with_earlier_segments``): its own row, or its trajectory's for a segment. Rows with
    # one number share tokens; ``balance.balanced_shards`` keeps them on one rank, where the
    # packed forward computes their shared tokens once. None: every row is its own.
    trajectory_index: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_length(self) -> int:
        """P: the column where responses start."""
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def response_length(self) -> int:
        """R."""
        return self.response_mask.shape[1]

    @property
    def response_attention_mask(self) -> torch.Tensor:
        """(B, R) 1 on every real response token, sampled or observed."""
        return self.attention_mask[:, self.prompt_length :]

    def replace(self, **fields: torch.Tensor | None) -> "TrainBatch":
        """A copy with some fields set (the step fills old_logprobs, advantages, ...)."""
        return dataclasses.replace(self, **fields)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def _map(self, fn) -> "TrainBatch":
        return TrainBatch(**{name: fn(name, value) for name, value in self.tensors().items()})

    def select(self, index: torch.Tensor | Sequence[int] | slice) -> "TrainBatch":
        """Rows by index (every field is indexed on its first dimension)."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        return self._map(lambda _, t: t[index])

    def to(self, device: torch.device | str) -> "TrainBatch":
        return self._map(lambda _, t: t.to(device))

    def split(self, size: int) -> list["TrainBatch"]:
        """Consecutive chunks of ``size`` rows (the last may be shorter). A chunk does not end
        inside a trajectory's rows (``trajectory_index``: its earlier segments), so it may hold
        more: the rows of one trajectory share most of their tokens, which the packed forward
        computes once only when they are in one micro-batch."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        owner = self.trajectory_index.tolist() if self.trajectory_index is not None else None
        starts = [0]
        for i in range(size, len(self)):
            if i - starts[-1] >= size and (owner is None or owner[i] != owner[i - 1] or owner[i] < 0):
                starts.append(i)
        return [self.select(slice(a, b)) for a, b in zip(starts, starts[1:] + [len(self)])]

    def shard(self, rank: int, world_size: int) -> "TrainBatch":
        """Rank ``rank``'s contiguous share of the rows; every rank gets the same number."""
        if len(self) % world_size != 0:
            raise ValueError(f"batch of {len(self)} rows cannot be sharded evenly over {world_size} ranks")
        per_rank = len(self) // world_size
        return self.select(slice(rank * per_rank, (rank + 1) * per_rank))

    def trim(self) -> "TrainBatch":
        """Drop columns that are padding in every row (left of the prompts, right of the responses).

        Micro-batches are trimmed before the forward pass: a micro-batch of short rows should not
        pay for the longest row of the whole batch. The prompt/response boundary is kept.
        """
        P = self.prompt_length
        prompt_real = self.attention_mask[:, :P].any(dim=0).nonzero()
        response_real = self.attention_mask[:, P:].any(dim=0).nonzero()
        # Keep at least one prompt column: its logits predict the first response token.
        start = min(int(prompt_real[0]) if len(prompt_real) else P - 1, P - 1)
        keep_r = int(response_real[-1]) + 1 if len(response_real) else 1
        response_fields = {"response_mask", "engine_logprobs", "token_rewards", "turn_ids", *_STEP_FIELDS}

        def cut(name: str, t: torch.Tensor) -> torch.Tensor:
            if name in ("input_ids", "attention_mask", "position_ids"):
                return t[:, start : P + keep_r]
            if name in response_fields:
                return t[:, :keep_r]
            return t

        return self._map(cut)

    def num_sampled_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    @staticmethod
    def concat(batches: Sequence["TrainBatch"]) -> "TrainBatch":
        """Stack rows of batches with the same layout (e.g. the shards returned by ranks)."""
        first = batches[0]
        names = first.tensors().keys()
        return TrainBatch(**{name: torch.cat([getattr(b, name) for b in batches]) for name in names})


def collate(
    trajectories: Sequence[Trajectory],
    *,
    pad_token_id: int,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> TrainBatch:
    """THE converter from trajectories to a training batch.

    Raises ``TrajectoryError`` naming the trajectory when its lengths disagree (ids, mask,
    logprobs, turn spans) or exceed the configured maxima: the trainer never truncates silently.
    """
    if not trajectories:
        raise TrajectoryError("cannot build a training batch from zero trajectories")
    for traj in trajectories:
        _check_trajectory(traj, max_prompt_length, max_response_length)

    group_of: dict[str, int] = {}
    group_index = [group_of.setdefault(t.group_id, len(group_of)) for t in trajectories]
    turn_rewards: list[list[float]] = []
    turn_ids_rows: list[list[int]] = []
    token_reward_rows: list[list[float]] = []
    for traj in trajectories:
        ids, rewards, per_turn = _turn_layout(traj)
        turn_ids_rows.append(ids)
        token_reward_rows.append(rewards)
        turn_rewards.append(per_turn)

    batch = collate_sequences(
        [t.prompt_ids for t in trajectories],
        [t.response_ids for t in trajectories],
        [t.response_mask for t in trajectories],
        pad_token_id=pad_token_id,
        logprobs=[t.logprobs for t in trajectories],
    )
    B, R = batch.response_mask.shape
    K = max(1, max(len(r) for r in turn_rewards))
    # Rows padded as Python lists, then one tensor per field: per-row tensor writes cost more.
    token_rewards = torch.tensor([r + [0.0] * (R - len(r)) for r in token_reward_rows], dtype=torch.float32)
    turn_ids = torch.tensor([t + [-1] * (R - len(t)) for t in turn_ids_rows], dtype=torch.long)
    turn_reward_t = torch.tensor([r + [0.0] * (K - len(r)) for r in turn_rewards], dtype=torch.float32)
    return batch.replace(
        token_rewards=token_rewards,
        turn_ids=turn_ids,
        turn_rewards=turn_reward_t,
        num_turns=torch.tensor([len(r) for r in turn_rewards], dtype=torch.long),
        group_index=torch.tensor(group_index, dtype=torch.long),
        scores=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32),
    )


def collate_sequences(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    response_masks: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    logprobs: Sequence[Sequence[float]] | None = None,
) -> TrainBatch:
    """Pad token sequences into the batch layout (no rewards, one group per row).

    The building block of :func:`collate`; SFT uses it directly with the assistant-token mask
    of a tokenized conversation as ``response_masks``.
    """
    B = len(prompts)
    if not (len(responses) == len(response_masks) == B) or (logprobs is not None and len(logprobs) != B):
        raise TrajectoryError("prompts, responses, masks (and logprobs) must have one entry per row")
    P = max(1, max(len(p) for p in prompts))
    R = max(1, max(len(r) for r in responses))
    ids_rows, attention_rows, mask_rows, logprob_rows = [], [], [], []
    for i, (prompt, response, mask) in enumerate(zip(prompts, responses, response_masks)):
        if len(prompt) == 0:
            raise TrajectoryError(f"row {i}: empty prompt (the first response token needs a context)")
        if len(mask) != len(response):
            raise TrajectoryError(f"row {i}: response ({len(response)}) and mask ({len(mask)}) lengths differ")
        left, right = P - len(prompt), R - len(response)
        ids_rows.append([pad_token_id] * left + list(prompt) + list(response) + [pad_token_id] * right)
        attention_rows.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
        mask_rows.append(list(mask) + [0] * right)
        if logprobs is not None:  # kept on sampled tokens only
            logprob_rows.append([lp if m else 0.0 for lp, m in zip(logprobs[i], mask)] + [0.0] * right)
    # Rows padded as Python lists, then one tensor per field: per-row tensor writes cost more.
    input_ids = torch.tensor(ids_rows, dtype=torch.long)
    attention_mask = torch.tensor(attention_rows, dtype=torch.long)
    response_mask = torch.tensor(mask_rows, dtype=torch.float32)
    engine_logprobs = torch.tensor(logprob_rows, dtype=torch.float32) if logprobs is not None else torch.zeros(B, R)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        engine_logprobs=engine_logprobs,
        token_rewards=torch.zeros(B, R),
        turn_ids=torch.full((B, R), -1, dtype=torch.long),
        turn_rewards=torch.zeros(B, 1),
        num_turns=torch.zeros(B, dtype=torch.long),
        group_index=torch.arange(B),
        scores=torch.zeros(B),
    )


def _check_trajectory(traj: Trajectory, max_prompt: int | None, max_response: int | None) -> None:
    name = f"trajectory {traj.row_id}#{traj.sample_index}"
    n = len(traj.response_ids)
    if len(traj.response_mask) != n or len(traj.logprobs) != n:
        raise TrajectoryError(
            f"{name}: response_ids ({n}), response_mask ({len(traj.response_mask)}) and "
            f"logprobs ({len(traj.logprobs)}) lengths differ"
        )
    if max_prompt is not None and len(traj.prompt_ids) > max_prompt:
        raise TrajectoryError(f"{name}: prompt has {len(traj.prompt_ids)} tokens, more than data.max_prompt_length = {max_prompt}")
    if max_response is not None and n > max_response:
        raise TrajectoryError(f"{name}: response has {n} tokens, more than data.max_response_length = {max_response}")
    position = 0
    for k, turn in enumerate(traj.turns):
        if turn.start != position or turn.end < turn.start:
            raise TrajectoryError(f"{name}: turn {k} spans [{turn.start}, {turn.end}) but the previous turn ended at {position}")
        expected = 1 if turn.role == "assistant" else 0
        if any(m != expected for m in traj.response_mask[turn.start : turn.end]):
            raise TrajectoryError(f"{name}: turn {k} ({turn.role}) has response_mask values other than {expected}")
        position = turn.end
    # what follows the last turn can only be template glue (the separator after a final
    # end-of-turn token), which is masked
    if any(traj.response_mask[position:]):
        raise TrajectoryError(f"{name}: turns cover {position} response tokens, but sampled tokens follow in a response of {n}")


def _turn_layout(traj: Trajectory) -> tuple[list[int], list[float], list[float]]:
    """Per-token turn ids and rewards, and the reward of each assistant turn.

    A turn reward goes on the last token of its assistant turn; the trajectory reward on the
    last sampled token of the whole response (so also into the last assistant turn's reward).
    """
    n = len(traj.response_ids)
    turn_ids = [-1] * n
    token_rewards = [0.0] * n
    per_turn: list[float] = []
    last_token_turn: tuple[int, int] | None = None  # (token position, assistant turn index)
    for turn in traj.turns:
        if turn.role != "assistant" or turn.length == 0:
            continue
        k = len(per_turn)
        for pos in range(turn.start, turn.end):
            turn_ids[pos] = k
        reward = float(turn.reward) if turn.reward is not None else 0.0
        token_rewards[turn.end - 1] += reward
        per_turn.append(reward)
        last_token_turn = (turn.end - 1, k)
    if last_token_turn is not None:
        pos, k = last_token_turn
        token_rewards[pos] += float(traj.reward)
        per_turn[k] += float(traj.reward)
    return turn_ids, token_rewards, per_turn
