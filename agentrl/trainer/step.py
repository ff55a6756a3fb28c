"""One training step: a batch of trajectories in, one update and its metrics out.

    collate -> old logprobs (unless on-policy) -> reference logprobs -> values -> advantages
            -> importance weights (off-policy replay only) -> critic update -> actor update

Online training (``trainer.run.Trainer.train_step``) is a rollout, this step, a weight sync
and a store write; replay retraining (``replay.train``) is a stored step read back and this
step. Each phase is timed (``timing/<phase>_s``).

Worker groups are reached through ``Group``: the Ray ``WorkerGroup`` of ``trainer.workers``,
or ``LocalGroup`` (one worker in this process: tests, debugging).

Off-policy correction (``max_ratio``): the stored logprobs are the behaviour policy's (the
engine that sampled); the policy recomputes its own (the old logprobs of the PPO ratio). Each
sampled token's advantage is scaled by the truncated importance ratio
``w = min(exp(old - behaviour), max_ratio)`` (0 on observed tokens); the PPO loss, clipped or
dual-clipped, is positively homogeneous in the advantage, so this weights the token's loss by
``w``. When the stored logprobs are the policy's own, ``w`` is exactly 1 and the update is the
online step's.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import torch

from agentrl.agent.call_stats import step_metrics as parse_rate_metrics
from agentrl.agent.roles import role_metrics, roles_per_sample
from agentrl.config.schema import TrainConfig
from agentrl.errors import AgentrlError, DataError
from agentrl.trainer.algorithms.advantages import estimate_advantages
from agentrl.trainer.algorithms.kl import apply_kl_penalty, kl_for_controller, kl_penalty
from agentrl.trainer.algorithms.masked import masked_mean, masked_var
from agentrl.trainer.algorithms.recipes import add_to_last_sampled_token, overlong_filter_mask, overlong_reward_penalty
from agentrl.trainer.balance import balanced_shards
from agentrl.trainer.batch import TrainBatch, collate
from agentrl.trainer.packed import pass_tokens
from agentrl.trainer.rank import mini_batch_denominator
from agentrl.trajectory import Trajectory, TrajectoryFinish

# the ends that cut a response at a length limit (DAPO's overlong filter drops them)
TRUNCATED = frozenset({TrajectoryFinish.LENGTH, TrajectoryFinish.RESPONSE_BUDGET})

__all__ = [
    "Group", "LocalGroup", "Groups", "StepResult", "TrainingStep", "usable_trajectories", "is_on_policy",
    "INFRA_FAILURES", "RolloutFailed", "failure_metrics", "check_weight_versions",
    "compute_advantages", "truncated_importance_weights", "trajectory_metrics", "pad_rows", "shards", "update", "timed",
]


class Group(Protocol):
    """What the step needs of a worker group (``trainer.workers.WorkerGroup`` or ``LocalGroup``)."""

    world_size: int

    def call_sharded(self, method: str, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]: ...

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...


class LocalGroup:
    """One worker in this process as a group of world size 1 (tests, debugging)."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.world_size = 1

    def call_sharded(self, method: str, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(shards[0], *args, **kwargs)]

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]


@dataclass
class Groups:
    """The worker groups one step drives; reference and critic only when the config asks."""

    actor: Group
    reference: Group | None = None
    critic: Group | None = None


@dataclass
class StepResult:
    batch: TrainBatch  # the batch as the update saw it (old logprobs, advantages, ... filled in)
    metrics: dict[str, float]
    updated_actor: bool  # False while only the critic trains (trainer.critic_warmup): no weight sync


# ----------------------------------------------------------------------------- pure parts


def is_on_policy(cfg: TrainConfig) -> bool:
    """One mini-batch, one epoch, no KL in the reward: the update's own forward gives the old
    logprobs (``ActorWorker.update_on_policy``), one forward pass fewer per step."""
    return (
        cfg.actor.ppo_epochs == 1
        and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
        and not cfg.algorithm.use_kl_in_reward
    )


# Finishes that say the infrastructure failed, not the policy: the engine failed a request after
# its retries (a server died, timed out, answered 5xx), aborted it, the loop itself raised, or
# the row's environment failed (its server died or timed out, its code raised).
# Such trajectories stay in the store (with ``reward_info["error"]``) but are left out of the loss;
# their group is re-normalised over the members that remain (the advantages group by
# ``group_id`` over the trajectories collated).
INFRA_FAILURES = frozenset({TrajectoryFinish.ENGINE_ERROR, TrajectoryFinish.ABORT, TrajectoryFinish.LOOP_ERROR,
                            TrajectoryFinish.ENVIRONMENT_ERROR})


class RolloutFailed(AgentrlError):
    """Too many trajectories of one step failed for infrastructure reasons (``trainer.max_failure_rate``),
    or some were sampled by weights a sync should have replaced. ``measure`` / ``value`` / ``key``:
    what was measured and the setting it broke; the trainer ends the run with them as a health stop
    (``stopped`` in the summary)."""

    def __init__(self, message: str, *, measure: str, value: float, key: str | None = None):
        super().__init__(message)
        self.measure, self.value, self.key = measure, value, key


def usable_trajectories(trajectories: Sequence[Trajectory], where: str) -> list[Trajectory]:
    """The trajectories with tokens to train on (infrastructure failures are left out of the loss)."""
    usable = [t for t in trajectories if t.finish_reason not in INFRA_FAILURES and t.response_ids]
    if not usable:
        reasons = sorted({f"{t.finish_reason}: {t.reward_info.get('error', '')}" for t in trajectories})
        raise DataError(f"{where}: none of the {len(trajectories)} trajectories has tokens to train on ({'; '.join(reasons)[:500]})")
    return usable


def failure_metrics(trajectories: Sequence[Trajectory], *, max_rate: float | None = None, where: str = "step") -> dict[str, float]:
    """``failures/<kind>`` (count per finish reason of ``INFRA_FAILURES``) and ``failures/rate``;
    with ``max_rate``, a rate above it raises ``RolloutFailed`` with the first failure's error in full."""
    failed = [t for t in trajectories if t.finish_reason in INFRA_FAILURES]
    kinds = Counter(str(t.finish_reason) for t in failed)
    rate = len(failed) / max(len(trajectories), 1)
    if max_rate is not None and rate > max_rate:
        first = failed[0]
        raise RolloutFailed(
            f"{where}: {len(failed)} of {len(trajectories)} trajectories failed ({dict(kinds)}), above "
            f"trainer.max_failure_rate={max_rate}. First failure, trajectory {first.group_id} "
            f"({first.finish_reason}):\n{first.reward_info.get('error', '(no error recorded)')}",
            measure="failures/rate", value=rate, key="trainer.max_failure_rate",
        )
    return {"failures/rate": rate, **{f"failures/{kind}": float(count) for kind, count in sorted(kinds.items())}}


def check_weight_versions(trajectories: Sequence[Trajectory], expected: int, where: str) -> None:
    """On-policy training: every sampled token came from the engine at weight version ``expected``
    (the last sync's); a trajectory sampled by an older version means a sync did not reach a server."""
    stale = [t for t in trajectories if t.metrics.get("weight_version_min", expected) < expected]
    if stale:
        t = stale[0]
        raise RolloutFailed(
            f"{where}: {len(stale)} trajectories were sampled by engine weights older than version {expected} "
            f"(first: {t.group_id}, versions {t.metrics['weight_version_min']:.0f}..{t.metrics['weight_version_max']:.0f}): "
            "a weight sync did not reach every server",
            measure="stale_trajectories", value=float(len(stale)),
        )


def compute_advantages(batch: TrainBatch, cfg: TrainConfig, kl_coef: float | None) -> tuple[TrainBatch, dict[str, float]]:
    """Rewards (with the KL penalty when asked) -> advantages and returns, per the estimator."""
    mask = batch.response_mask
    token_rewards, turn_rewards, metrics = batch.token_rewards, batch.turn_rewards, {}
    alg = cfg.algorithm
    if alg.use_kl_in_reward and batch.ref_logprobs is not None and kl_coef is not None:
        penalized, kl = apply_kl_penalty(token_rewards, batch.old_logprobs, batch.ref_logprobs, mask, kl_coef, alg.kl_penalty)
        penalty = penalized - token_rewards  # (B, R), negative
        # the turn-level estimators see each turn's summed penalty in that turn's reward
        index = batch.turn_ids.clamp(min=0)
        per_turn = torch.zeros_like(turn_rewards).scatter_add_(1, index, penalty * (batch.turn_ids >= 0))
        token_rewards, turn_rewards = penalized, turn_rewards + per_turn
        metrics["kl/reward_penalty_kl"] = float(kl)
    advantages, returns = estimate_advantages(
        alg.adv_estimator, token_rewards=token_rewards, response_mask=mask, group_ids=batch.group_index,
        gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        rpp_reset_at_observations=alg.rpp_reset_at_observations, grpo_turn_credit=alg.grpo_turn_credit,
        turn_gamma=alg.turn_gamma, values=batch.values, turn_rewards=turn_rewards, num_turns=batch.num_turns,
        turn_ids=batch.turn_ids,
    )
    metrics["advantages/mean"] = float(masked_mean(advantages, mask))
    metrics["advantages/abs_max"] = float((advantages.abs() * mask).max())
    return batch.replace(advantages=advantages, returns=returns), metrics


def with_earlier_segments(trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], list[int], list[int]]:
    """The rows to train, the row whose advantage each takes (-1: its own) and the row where each
    group's block starts. Without earlier segments: the trajectories as given and no blocks
    (mini-batches go by row count). With them (an agent program rewrote its history,
    ``Trajectory.earlier_segments``): each of a group's trajectories followed by its earlier
    segments, each segment a row in a group of its own so that it stays out of the group's
    statistics; a mini-batch of k groups starts at every k-th block (``mini_batch_starts``), its
    groups' segments with it. A trajectory's rows are adjacent, so that they land in one
    micro-batch where its size allows, and the packed forward computes the tokens they share once
    (``packed.py``; ``trajectory_indices`` keeps them on one rank)."""
    if not any(t.earlier_segments for t in trajectories):
        return list(trajectories), [-1] * len(trajectories), []
    by_group: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_group.setdefault(t.group_id, []).append(t)
    rows: list[Trajectory] = []
    parent: list[int] = []
    blocks: list[int] = []
    for members in by_group.values():
        blocks.append(len(rows))
        for t in members:
            own = len(rows)
            rows.append(t)
            parent.append(-1)
            for k, seg in enumerate(t.earlier_segments):
                rows.append(dataclasses.replace(
                    t, group_id=f"{t.group_id}#{t.sample_index}/segment{k}", prompt_ids=seg.prompt_ids,
                    response_ids=seg.response_ids, response_mask=seg.response_mask, logprobs=seg.logprobs,
                    token_versions=seg.token_versions,
                    turns=[dataclasses.replace(x, reward=None) for x in seg.turns], reward=0.0, tool_calls=[],
                    earlier_segments=[]))
                parent.append(own)
    return rows, parent, blocks


def trajectory_indices(parent: Sequence[int]) -> torch.Tensor | None:
    """``TrainBatch.trajectory_index`` from ``with_earlier_segments``' parents: each row's
    trajectory row (None when no row has a parent: every row is its own)."""
    if all(p < 0 for p in parent):
        return None
    return torch.tensor([p if p >= 0 else row for row, p in enumerate(parent)], dtype=torch.long)


def mini_batch_starts(blocks: Sequence[int], groups_per_mini: int) -> list[int]:
    """Where mini-batches of ``groups_per_mini`` group blocks start (none without blocks)."""
    return list(blocks[::groups_per_mini])


def share_advantages(batch: TrainBatch, parent: Sequence[int]) -> TrainBatch:
    """Rows with a parent take the parent's advantage and return at its first sampled token, on
    each of their own sampled tokens (for GRPO and RLOO that is the trajectory's advantage)."""
    index = torch.tensor(parent, dtype=torch.long)
    rows = (index >= 0).nonzero()[:, 0]
    if not len(rows):
        return batch
    source = index[rows]
    first = batch.response_mask[source].argmax(-1)  # the first sampled token of each parent

    def shared(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        out[rows] = x[source, first][:, None] * batch.response_mask[rows]
        return out

    return batch.replace(advantages=shared(batch.advantages), returns=shared(batch.returns))


def overlong_shaping(batch: TrainBatch, trajectories: Sequence[Trajectory], cfg: TrainConfig) -> tuple[TrainBatch, dict[str, float]]:
    """DAPO's length shaping, when configured: the soft overlong penalty joins each trajectory's
    reward (on its last sampled token and its last turn), and overlong filtering leaves responses
    that hit the length limit out of the loss."""
    metrics: dict[str, float] = {}
    buffer = cfg.algorithm.overlong_buffer
    if buffer.enable:
        lengths = torch.tensor([len(t.response_ids) for t in trajectories])
        penalty = overlong_reward_penalty(lengths, cfg.data.max_response_length, buffer.len, buffer.penalty_factor)  # (B,)
        last_turn = (batch.num_turns - 1).clamp(min=0).unsqueeze(1)  # (B, 1)
        batch = batch.replace(
            token_rewards=add_to_last_sampled_token(batch.token_rewards, batch.response_mask, penalty),
            turn_rewards=batch.turn_rewards.scatter_add(1, last_turn, penalty.unsqueeze(1)),
        )
        metrics["overlong/penalized_fraction"] = float((penalty < 0).float().mean())
    if cfg.algorithm.overlong_filter:
        truncated = torch.tensor([t.finish_reason in TRUNCATED for t in trajectories])
        batch = batch.replace(response_mask=overlong_filter_mask(truncated, batch.response_mask))
        metrics["overlong/filtered_fraction"] = float(truncated.float().mean())
    return batch, metrics


def truncated_importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, max_ratio: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, R) weights ``min(exp(old - behaviour), max_ratio)`` on sampled tokens (0 elsewhere),
    and the ratio metrics."""
    if max_ratio <= 0:
        raise ValueError(f"max_ratio must be > 0, got {max_ratio}")
    delta = (old_logprobs - behaviour_logprobs) * mask  # (B, R)
    ratio = torch.exp(delta) * mask  # (B, R)
    weights = ratio.clamp(max=max_ratio)  # (B, R)
    count = mask.sum().clamp(min=1)
    metrics = {
        "logprob_mismatch/mean": float(delta.abs().sum() / count),
        "logprob_mismatch/max": float(delta.abs().max()) if delta.numel() else 0.0,
        "replay/ratio_mean": float(ratio.sum() / count),
        "replay/ratio_max": float(ratio.max()) if ratio.numel() else 0.0,
        "replay/truncated_fraction": float(((ratio > max_ratio) * mask).sum() / count),
    }
    return weights, metrics


def trajectory_metrics(trajectories: Sequence[Trajectory], prefix: str = "") -> dict[str, float]:
    n = max(len(trajectories), 1)
    rewards = torch.tensor([t.reward for t in trajectories] or [0.0])
    m: dict[str, float] = {
        f"{prefix}reward/mean": float(rewards.mean()),
        f"{prefix}reward/std": float(rewards.std()) if len(trajectories) > 1 else 0.0,
        f"{prefix}success_rate": float((rewards >= 1.0 - 1e-6).float().mean()),
        f"{prefix}turns/mean": sum(t.metrics.get("turns", 0.0) for t in trajectories) / n,
        f"{prefix}tool_calls/mean": sum(t.metrics.get("tool_calls", 0.0) for t in trajectories) / n,
        # the share of trajectories that call a tool at all (what a policy learning to use its tools raises)
        f"{prefix}tool_use_rate": sum(1 for t in trajectories if t.metrics.get("tool_calls", 0.0) > 0) / n,
        f"{prefix}response_length/mean": sum(len(t.response_ids) for t in trajectories) / n,
    }
    turn_rewards = [x.reward for t in trajectories for x in t.turns if x.role == "assistant" and x.reward is not None]
    if turn_rewards:
        m[f"{prefix}turn_reward/mean"] = sum(turn_rewards) / len(turn_rewards)
        m[f"{prefix}turn_reward/count"] = float(len(turn_rewards))
    for t in trajectories:
        m[f"{prefix}finish/{t.finish_reason}"] = m.get(f"{prefix}finish/{t.finish_reason}", 0.0) + 1.0 / n
        for key, value in t.metrics.items():
            # counts: malformed calls by kind, program exceptions by type, environment failures by kind
            if key.startswith(("tool_errors/", "program_errors/", "env_errors/")):
                m[f"{prefix}{key}"] = m.get(f"{prefix}{key}", 0.0) + value
    m.update(tool_call_metrics(trajectories, prefix))
    m.update(role_metrics(trajectories, prefix))  # role/<name>/reward, tokens, tool_calls (agentrl.agent.roles)
    m.update(parse_rate_metrics(trajectories, prefix))  # tool_calls/parsed, malformed_rate, unparsed_turn_rate, ...
    # what interactions (interaction/<key>, summed over the trajectory's turns), custom loops
    # (loop/<key>) and environments (env/<reward function>, agentrl.environments) emit: the mean
    # over the trajectories that report the key
    emitted: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in t.metrics.items():
            if key.startswith(("interaction/", "loop/", "env/")):
                emitted.setdefault(key, []).append(float(value))
    m.update({f"{prefix}{key}": sum(v) / len(v) for key, v in emitted.items()})
    # the retry task: success at the second attempt (first answer judged wrong, second right)
    second = [t for t in trajectories if sum(1 for x in t.turns if x.role == "user") >= 1]
    if second:
        m[f"{prefix}retry/second_attempt_success"] = sum(1 for t in second if t.reward >= 1.0 - 1e-6) / len(second)
    # several data sources (verl reports validation per source too): each one's success and tool use
    sources: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        sources.setdefault(t.data_source, []).append(t)
    if len(sources) > 1:
        for source, group in sources.items():
            m[f"{prefix}source/{source}/success_rate"] = sum(1 for t in group if t.reward >= 1.0 - 1e-6) / len(group)
            m[f"{prefix}source/{source}/tool_use_rate"] = sum(1 for t in group if t.metrics.get("tool_calls", 0.0) > 0) / len(group)
    return m


def tool_call_metrics(trajectories: Sequence[Trajectory], prefix: str = "") -> dict[str, float]:
    """Per tool name over every call of the batch: ``tool/<name>/calls`` (the count) and
    ``tool/<name>/<metric>`` (the mean of ``ToolResult.metrics[metric]`` over the calls that gave it)."""
    calls: dict[str, int] = {}
    sums: dict[tuple[str, str], list[float]] = {}
    for t in trajectories:
        for c in t.tool_calls:
            if c.name is None or c.error in ("bad_json", "unknown_tool"):  # counted in tool_errors/*, not per name:
                continue  # a misspelled name must not become a metric key of its own
            calls[c.name] = calls.get(c.name, 0) + 1
            for key, value in c.metrics.items():
                acc = sums.setdefault((c.name, key), [0.0, 0.0])
                acc[0] += float(value)
                acc[1] += 1.0
    m = {f"{prefix}tool/{name}/calls": float(n) for name, n in calls.items()}
    for (name, key), (total, count) in sums.items():
        m[f"{prefix}tool/{name}/{key}"] = total / count
    return m


def pad_rows(batch: TrainBatch, multiple: int) -> TrainBatch:
    """Append loss-free copies of row 0 so the row count divides ``multiple`` (for sharding)."""
    extra = (-len(batch)) % multiple
    if extra == 0:
        return batch
    filler = batch.select([0] * extra).replace(response_mask=torch.zeros_like(batch.response_mask[:extra]))
    return TrainBatch.concat([batch, filler])


def shards(batch: TrainBatch, world_size: int) -> list[TrainBatch]:
    """One shard per rank (rows padded with loss-free copies so they divide evenly)."""
    padded = pad_rows(batch, world_size)
    return [padded.shard(rank, world_size) for rank in range(world_size)]


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    var = masked_var(returns, mask)
    return float(1 - masked_var(returns - values, mask) / var) if var > 0 else 0.0


@contextmanager
def timed(timings: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[f"timing/{phase}_s"] = time.perf_counter() - start


def update(group: Group, batch: TrainBatch, mini_size: int, epochs: int, mode: str, *, starts: Sequence[int] = (),
           **kwargs: Any) -> dict[str, float]:
    """``epochs`` passes over mini-batches of ``mini_size`` trajectories (or starting at the rows
    ``starts``, when given), each sharded over the group's ranks; the ranks' metrics averaged."""
    bounds = list(starts) + [len(batch)]
    split = [batch.select(slice(a, b)) for a, b in zip(bounds, bounds[1:])] if starts else batch.split(mini_size)
    minis = [mb for _ in range(epochs) for mb in split]
    denominators = [mini_batch_denominator(mb.response_mask, mode) for mb in minis]
    per_mini = [balanced_shards(mb, group.world_size).shards for mb in minis]
    per_rank = [[mini[rank] for mini in per_mini] for rank in range(group.world_size)]
    results = group.call_sharded("update", per_rank, denominators, **kwargs)
    return {k: sum(r[k] for r in results) / len(results) for k in results[0]}


# ----------------------------------------------------------------------------- the step


class TrainingStep:
    """The step, with its config and worker groups fixed at construction; trajectories per call.

    ``kl_ctrl`` (a fixed or adaptive KL controller) gives the KL coefficient of the reward
    penalty and is updated from the step's KL when ``algorithm.use_kl_in_reward``."""

    def __init__(self, cfg: TrainConfig, groups: Groups, *, pad_token_id: int, kl_ctrl: Any = None):
        self.cfg, self.groups, self.pad_token_id, self.kl_ctrl = cfg, groups, pad_token_id, kl_ctrl

    def online(self, trajectories: Sequence[Trajectory], *, step: int) -> StepResult:
        """Online training's update from the trajectories just rolled out; ``step`` counts the
        updates before this one (messages name the step from 1, as the console does)."""
        cfg = self.cfg
        where = f"step {step + 1}"
        failure_metrics(trajectories, max_rate=cfg.trainer.max_failure_rate, where=where)  # before any compute
        # a loop with roles makes a trajectory per role of each sample, each role a group of its own
        return self(trajectories, group_size=cfg.rollout.n * roles_per_sample(trajectories), on_policy=is_on_policy(cfg),
                    update_actor=step >= cfg.trainer.critic_warmup, where=where)

    def replay(self, trajectories: Sequence[Trajectory], *, max_ratio: float, update_actor: bool = True,
               where: str = "stored step") -> StepResult:
        """An update from stored trajectories, each token weighted by its truncated importance
        ratio against the stored (behaviour) logprobs."""
        return self(trajectories, max_ratio=max_ratio, update_actor=update_actor, where=where)

    def __call__(
        self,
        trajectories: Sequence[Trajectory],
        *,
        group_size: int | None = None,
        on_policy: bool = False,
        update_actor: bool = True,
        max_ratio: float | None = None,
        where: str = "step",
    ) -> StepResult:
        """One update from ``trajectories`` (infrastructure failures, ``INFRA_FAILURES``, and empty
        responses are left out of the loss, counted in ``trajectories/loop_errors`` and
        ``failures/<kind>``). Mini-batches hold ``ppo_mini_batch_size``
        prompts × ``group_size`` trajectories (default: the largest group among them).
        ``on_policy`` takes the old logprobs from the update's own forward (needs
        ``is_on_policy(cfg)``); ``update_actor=False`` trains the critic only
        (``trainer.critic_warmup``); ``max_ratio`` weights each token's advantage by its truncated
        importance ratio against the trajectory's own (engine) logprobs."""
        cfg, groups = self.cfg, self.groups
        if on_policy and max_ratio is not None:
            raise ValueError("the on-policy update takes its old logprobs after the advantages: it cannot weight them")
        timings: dict[str, float] = {}
        start = time.perf_counter()
        usable = usable_trajectories(trajectories, where)
        if group_size is None:
            group_size = max(Counter(t.group_id for t in usable).values())
        rows, parent, blocks = with_earlier_segments(usable)
        batch = collate(rows, pad_token_id=self.pad_token_id, max_prompt_length=cfg.data.max_prompt_length,
                        max_response_length=cfg.data.max_response_length)
        batch = batch.replace(trajectory_index=trajectory_indices(parent))
        batch, shaping_metrics = overlong_shaping(batch, rows, cfg)
        actor, micro = groups.actor, cfg.actor.ppo_micro_batch_size_per_gpu
        on_policy = on_policy and update_actor
        entropy = None
        if not on_policy:
            with timed(timings, "old_logprobs"):
                split = balanced_shards(batch, actor.world_size)
                parts = actor.call_sharded("compute_logprobs", split.shards, micro)
                old, entropy = (split.gather([p[i] for p in parts]) for i in (0, 1))
                batch = batch.replace(old_logprobs=old)
        if groups.reference is not None:
            with timed(timings, "ref_logprobs"):
                split = balanced_shards(batch, groups.reference.world_size)
                ref = groups.reference.call_sharded("compute_logprobs", split.shards, micro)
                batch = batch.replace(ref_logprobs=split.gather(ref))
        if groups.critic is not None:
            with timed(timings, "values"):
                split = balanced_shards(batch, groups.critic.world_size)
                values = groups.critic.call_sharded("compute_values", split.shards, cfg.critic.ppo_micro_batch_size_per_gpu)
                batch = batch.replace(values=split.gather(values))
        weight_metrics: dict[str, float] = {}
        with timed(timings, "advantages"):
            batch, adv_metrics = compute_advantages(batch, cfg, self.kl_ctrl.value if self.kl_ctrl is not None else None)
            batch = share_advantages(batch, parent)
            if max_ratio is not None:
                weights, weight_metrics = truncated_importance_weights(batch.old_logprobs, batch.engine_logprobs,
                                                                       batch.response_mask, max_ratio)
                batch = batch.replace(advantages=batch.advantages * weights)
        metrics: dict[str, float] = {}
        mode = cfg.actor.loss_agg_mode
        if groups.critic is not None:
            with timed(timings, "critic_update"):
                metrics.update(update(groups.critic, batch, cfg.critic.ppo_mini_batch_size * group_size, cfg.critic.ppo_epochs,
                                      mode, starts=mini_batch_starts(blocks, cfg.critic.ppo_mini_batch_size),
                                      loss_agg_mode=mode))
        if on_policy:
            with timed(timings, "actor_update"):
                denominator = mini_batch_denominator(batch.response_mask, mode)
                split = balanced_shards(batch, actor.world_size)
                parts = actor.call_sharded("update_on_policy", split.shards, denominator, use_kl_loss=cfg.actor.use_kl_loss)
                metrics.update({k: sum(p[0][k] for p in parts) / len(parts) for k in parts[0][0]})
                old, entropy = (split.gather([p[i] for p in parts]) for i in (1, 2))
                batch = batch.replace(old_logprobs=old)
        elif update_actor:
            with timed(timings, "actor_update"):
                metrics.update(update(actor, batch, cfg.actor.ppo_mini_batch_size * group_size, cfg.actor.ppo_epochs,
                                      mode, starts=mini_batch_starts(blocks, cfg.actor.ppo_mini_batch_size),
                                      use_kl_loss=cfg.actor.use_kl_loss))

        mask = batch.response_mask
        mismatch = (batch.engine_logprobs - batch.old_logprobs).abs() * mask  # the engine's against the trainer's
        metrics.update(trajectory_metrics(trajectories))
        metrics.update(adv_metrics)
        metrics.update(timings)
        metrics.update({
            # the busiest actor rank's tokens over the mean rank's (1.0: the ranks finish together)
            "balance/actor_token_imbalance": balanced_shards(batch, actor.world_size).imbalance,
            "entropy/mean": float(masked_mean(entropy, mask)),
            "logprob_mismatch/mean": float(mismatch.sum() / mask.sum().clamp(min=1)),
            "logprob_mismatch/max": float(mismatch.max()) if mismatch.numel() else 0.0,
            "tokens/sampled": float(mask.sum()),
            "trajectories/loop_errors": float(len(trajectories) - len(usable)),
            "trajectories/earlier_segments": float(len(rows) - len(usable)),  # trained as rows of their own
        })
        metrics.update(failure_metrics(trajectories))
        # what one actor pass feeds the packed forward (prefix trees per micro-batch) and what one
        # forward per row would, against metrics' tokens/sampled: shared tokens computed once
        passed = pass_tokens(balanced_shards(batch, actor.world_size).shards, micro)
        metrics.update({"perf/tokens_computed": float(passed.computed), "perf/tokens_rows": float(passed.rows)})
        metrics.update(weight_metrics)
        metrics.update(shaping_metrics)
        if batch.ref_logprobs is not None:
            metrics["kl/policy_ref"] = float(masked_mean(kl_penalty(batch.old_logprobs, batch.ref_logprobs, "k1"), mask))
            if self.kl_ctrl is not None:
                if cfg.algorithm.use_kl_in_reward:  # fed what verl feeds it: the configured KL kind, per-sequence means
                    kl = kl_for_controller(batch.old_logprobs, batch.ref_logprobs, mask, cfg.algorithm.kl_penalty)
                    self.kl_ctrl.update(float(kl), len(batch))
                metrics["kl/coef"] = self.kl_ctrl.value
        if batch.values is not None:
            metrics["critic/explained_variance"] = explained_variance(batch.returns, batch.values, mask)
            metrics["critic/values_mean"] = float(masked_mean(batch.values, mask))
        metrics["timing/step_s"] = time.perf_counter() - start
        return StepResult(batch=batch, metrics=metrics, updated_actor=update_actor)
