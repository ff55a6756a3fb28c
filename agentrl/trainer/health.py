"""The run's health checks (``trainer.health``, docs/training.md "Run health"): each step's
measures against their bounds, so that a run whose engine does not serve the trained policy, or
which cannot learn, says so at the step it starts instead of training on.

* The served policy is the trained one. After each weight sync the engine reports the version it
  holds; another than the one synced stops the run at once. The tokens sampled at the trainer's
  weight version are scored by the trainer under that version (the step's old logprobs; on-policy,
  the update's own forward): their mean absolute logprob difference, ``health/logprob_mismatch``,
  is float rounding (about 1e-7 in fp32, 1e-3 to 1e-2 in bf16) unless the engine holds other
  weights. An asynchronous step trains on tokens of older versions too, which differ from the
  trainer's by the updates since, as they should: only the tokens of the trainer's version count.
* A run that cannot learn: the share of groups whose samples all got one reward (no advantage),
  the tool error rate by kind, the malformed-call rate, the infrastructure failure rate, the share
  of finished groups dropped as stale.

A measure at or above its ``warn`` bound on ``warn_steps`` consecutive steps prints one warning
naming it, its value, its key and its likely causes; at or above ``stop`` on ``stop_steps``
consecutive steps the run saves a checkpoint and stops, the stop recorded in ``summary.json``
(``stopped``) and the report; ``trainer.resume=auto`` goes on from the checkpoint once the cause
is fixed (or the bound raised).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from agentrl.config.health import GROUP_RELATIVE
from agentrl.config.schema import HealthBound, HealthConfig
from agentrl.errors import AgentrlError
from agentrl.trainer.batch import TrainBatch, collate_sequences
from agentrl.trainer.step import shards, usable_trajectories, with_earlier_segments
from agentrl.trajectory import NO_VERSION, Trajectory

__all__ = ["HealthMonitor", "HealthStop", "step_health_metrics", "served_policy_mismatch", "uniform_group_share",
           "tool_error_rates", "probe_served_policy", "engine_version_stop", "CAUSES", "EXECUTION_ERRORS"]

# the tool call errors of a tool that ran (or was to run) and failed; bad_json, unknown_tool and
# invalid_arguments are the policy's malformed calls (tool_calls/malformed_rate)
EXECUTION_ERRORS = ("tool_exception", "timeout")
MALFORMED = ("bad_json", "unknown_tool", "invalid_arguments")

# measure -> what it says and its likely causes, for the warning and the stop
CAUSES: dict[str, str] = {
    "logprob_mismatch": (
        "the engine that sampled does not hold the weights the trainer synced: its logprobs of the sampled tokens "
        "differ from the trainer's under the same version. Likely causes: a weight sync that did not reach the engine "
        "or copied a stale state (engine.weight_sync), LoRA adapters not merged into the served weights, a server "
        "restarted on other weights, or engine and trainer in different precisions (bf16 against fp32 differs by "
        "about 1e-2: raise the bound)"),
    "uniform_groups": (
        "every sample of these groups got the same reward: nothing tells their samples apart (a group-relative "
        "advantage is 0; GRPO, RLOO and DAPO learn nothing from them). Likely "
        "causes: a reward function that returns a constant (check reward.default and the data's reward_model), a task "
        "too hard (all 0) or already solved (all 1) for this policy, rollout.n too small, rollout.temperature 0"),
    "tool_errors": (
        "tool calls fail when they run. Likely causes: the tool raises on every call (its traceback is in the rollouts' "
        "tool results), a sandbox or service it needs is down, agent.tool_timeout_s too short"),
    "malformed_calls": (
        "the policy's tool calls do not parse. Likely causes: agent.tool_parser does not match the model's call format "
        "(the chat template's), a base model never taught to call tools (start from SFT), data.max_response_length "
        "or rollout.max_new_tokens cutting calls short"),
    "failures": (
        "trajectories fail for infrastructure reasons (failures/<kind>: engine_error, environment_error, loop_error, "
        "abort) and are left out of the loss. Likely causes: an engine server or environment server that dies or times "
        "out, an environment whose code raises; the first error is in the rollouts' reward_info"),
    "stale_groups": (
        "finished groups are dropped as older than rollout.max_staleness versions: generation is wasted. Likely "
        "causes: generation much slower than training, rollout.max_staleness too small for the spread of trajectory "
        "lengths; rollout.stale_groups=wait trains them instead"),
}


class HealthStop(AgentrlError):
    """A health check stopped the run, or a rollout's failures did (``RolloutFailed``, as one): not an
    error of agentrl's, the run's data or setup."""

    def __init__(self, message: str, *, step: int, key: str | None, measure: str, value: float):
        super().__init__(message)
        self.step, self.key, self.measure, self.value = step, key, measure, value

    def record(self) -> dict[str, Any]:
        """What ``summary.json`` keeps of the stop (``stopped``)."""
        return {"step": self.step, "measure": self.measure, "value": self.value, "key": self.key, "reason": str(self)}


# ----------------------------------------------------------------------------- per-step measures


def served_policy_mismatch(trajectories: Sequence[Trajectory], batch: TrainBatch, version: int) -> tuple[float, int]:
    """The mean |engine - trainer| logprob over the sampled tokens of weight version ``version``
    (the trainer's, whose old logprobs ``batch`` holds) and their count. ``batch``: the step's
    (``StepResult.batch``), collated from the same trajectories in the same order."""
    rows, _, _ = with_earlier_segments(usable_trajectories(trajectories, "the health check"))
    R = batch.response_length
    versions = torch.full((len(rows), R), NO_VERSION, dtype=torch.long)  # (B, R)
    for i, t in enumerate(rows):
        known = t.token_versions or (
            # a trajectory without per-token versions (a store before schema 5): all of one version when its metrics say so
            [version] * len(t.response_ids)
            if t.metrics.get("weight_version_min") == t.metrics.get("weight_version_max") == version else [])
        versions[i, : len(known)] = torch.tensor(known[:R], dtype=torch.long)
    assert batch.old_logprobs is not None, "the step fills old_logprobs"
    fresh = batch.response_mask[: len(rows)] * (versions == version)  # (B, R)
    tokens = int(fresh.sum())
    delta = (batch.engine_logprobs[: len(rows)] - batch.old_logprobs[: len(rows)]).abs() * fresh  # (B, R)
    return (float(delta.sum()) / tokens if tokens else 0.0), tokens


def uniform_group_share(trajectories: Sequence[Trajectory]) -> float | None:
    """The share of groups (of two or more usable samples) whose rewards, trajectory and per turn,
    are all equal; None when no group has two samples (rollout.n=1: nothing to compare)."""
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        if t.response_ids:
            groups[t.group_id].append(t)
    sized = [g for g in groups.values() if len(g) > 1]
    if not sized:
        return None

    def rewards(t: Trajectory) -> tuple[float, ...]:
        return (t.reward, *(x.reward or 0.0 for x in t.turns if x.role == "assistant"))

    def alike(group: list[Trajectory]) -> bool:
        first = rewards(group[0])
        return all(len(rewards(t)) == len(first) and all(abs(a - b) < 1e-6 for a, b in zip(rewards(t), first))
                   for t in group[1:])

    return sum(1 for g in sized if alike(g)) / len(sized)


def tool_error_rates(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per error kind: the share of the step's tool calls that ended with it."""
    calls = [c for t in trajectories for c in t.tool_calls]
    kinds: dict[str, int] = defaultdict(int)
    for c in calls:
        if c.error:
            kinds[c.error] += 1
    return {kind: n / len(calls) for kind, n in sorted(kinds.items())}


def step_health_metrics(trajectories: Sequence[Trajectory], batch: TrainBatch, version: int, *,
                        dropped_groups: int = 0, estimator: str = "grpo") -> dict[str, float]:
    """``health/*``: the step's measures (``HealthMonitor.check`` reads them with the rest);
    uniform groups only for a group-relative ``estimator`` (``algorithm.adv_estimator``)."""
    mismatch, tokens = served_policy_mismatch(trajectories, batch, version)
    metrics = {"health/logprob_mismatch": mismatch, "health/mismatch_tokens": float(tokens), "health/weight_version": float(version)}
    uniform = uniform_group_share(trajectories) if estimator in GROUP_RELATIVE else None
    if uniform is not None:
        metrics["health/uniform_groups"] = uniform
    metrics.update({f"health/tool_error_rate/{kind}": rate for kind, rate in tool_error_rates(trajectories).items()})
    if dropped_groups:
        trained = len({t.group_id for t in trajectories})
        metrics["health/stale_groups"] = dropped_groups / (dropped_groups + trained)
    return metrics


def malformed_example(trajectories: Sequence[Trajectory]) -> str | None:
    """The text of the step's first malformed tool call (bad JSON, an unknown tool, arguments its
    schema refuses), for the malformed-call warning; None when there is none."""
    return next((c.raw for t in trajectories for c in t.tool_calls if c.error in MALFORMED), None)


def probe_served_policy(actor: Any, prompt_ids: Sequence[int], *, pad_token_id: int, micro_batch_size: int, seed: int,
                        max_new_tokens: int = 16) -> tuple[float, int, list[int]]:
    """Asynchronous training's deep check, right after a sync: the engine samples a few tokens
    (``ActorWorker.probe_engine``) and the trainer, which holds the version just synced, scores
    them. Returns the mean |engine - trainer| logprob, the token count and the versions that sampled."""
    ids, logprobs, versions = actor.call_rank0("probe_engine", list(prompt_ids), max_new_tokens, seed)
    if not ids:
        return 0.0, 0, []
    batch = collate_sequences([prompt_ids], [ids], [[1] * len(ids)], pad_token_id=pad_token_id, logprobs=[logprobs])
    parts = actor.call_sharded("compute_logprobs", shards(batch, actor.world_size), micro_batch_size)
    trainer = parts[0][0][0, : len(ids)]  # rank 0's shard holds the row
    return float((torch.tensor(logprobs) - trainer).abs().mean()), len(ids), sorted(set(versions))


def engine_version_stop(reported: int | None, synced: int, *, step: int, sync: str) -> HealthStop | None:
    """The engine holds another version than the one just synced (None: no engine to ask);
    ``sync``: how the weights travel (``engine.weight_sync``'s value), for the message."""
    if reported is None or reported == synced:
        return None
    return HealthStop(
        f"step {step}: after the weight sync to version {synced} the engine reports weight version {reported}: it serves "
        f"another policy than the one trained, and every later step would train on its samples. Likely causes: a weight "
        f"sync that did not reach the engine (engine.weight_sync={sync}), an engine server restarted or replaced "
        f"since, two trainers syncing one server", step=step, key="engine weight version", measure="engine_version",
        value=float(reported))


# ----------------------------------------------------------------------------- the monitor


@dataclass
class _Streak:
    warn: int = 0
    stop: int = 0
    warned: bool = False


@dataclass
class HealthMonitor:
    """Counts each measure's consecutive steps over its bounds; warns once a streak, stops."""

    config: HealthConfig
    say: Callable[[str], None] = print
    weight_sync: str = "auto"  # engine.weight_sync, for the messages
    parser: str = "auto"  # the tool parser that read the calls (agent.tool_parser, resolved), for the messages
    example: str | None = None  # a malformed call of the step (``malformed_example``), for the messages
    streaks: dict[str, _Streak] = field(default_factory=dict)

    def measures(self, metrics: dict[str, float]) -> list[tuple[str, str, float]]:
        """(measure name, bound name, value) of the step: ``tool_errors/<kind>`` per execution error kind."""
        out = []
        for bound in ("logprob_mismatch", "uniform_groups", "stale_groups"):
            if f"health/{bound}" in metrics:
                if bound == "logprob_mismatch" and not metrics.get("health/mismatch_tokens", 1.0):
                    continue  # no token of the trainer's version this step (asynchronous): nothing to compare
                out.append((bound, bound, metrics[f"health/{bound}"]))
        for kind in EXECUTION_ERRORS:
            out.append((f"tool_errors/{kind}", "tool_errors", metrics.get(f"health/tool_error_rate/{kind}", 0.0)))
        out.append(("malformed_calls", "malformed_calls", metrics.get("tool_calls/malformed_rate", 0.0)))
        # turns holding the parser's call marker with no call read: attempts the parser missed
        out.append(("unparsed_turns", "malformed_calls", metrics.get("tool_calls/unparsed_turn_rate", 0.0)))
        out.append(("failures", "failures", metrics.get("failures/rate", 0.0)))
        return out

    def check(self, step: int, metrics: dict[str, float]) -> None:
        """Warn for the measures that reached their warn streak at ``step``; raise ``HealthStop``
        for the first that reached its stop streak, or at once when the engine reports holding
        another weight version than the one synced."""
        if "health/synced_version" in metrics:
            stop = engine_version_stop(int(metrics["health/engine_version"]), int(metrics["health/synced_version"]),
                                       step=step, sync=self.weight_sync)
            if stop is not None:
                raise stop
        for name, bound_name, value in self.measures(metrics):
            bound: HealthBound = getattr(self.config, bound_name)
            streak = self.streaks.setdefault(name, _Streak())
            key = f"trainer.health.{bound_name}"
            streak.warn = streak.warn + 1 if bound.warn is not None and value >= bound.warn else 0
            streak.stop = streak.stop + 1 if bound.stop is not None and value >= bound.stop else 0
            what = name
            if bound_name == "logprob_mismatch":  # the versions: the trainer's, which sampled the tokens compared
                what = f"{name} of the tokens sampled at weight version {metrics.get('health/weight_version', 0):.0f}"
            if bound_name == "malformed_calls":  # which parser, and what the policy wrote
                example = f"; a malformed call: {self.example[:160]!r}" if self.example and name == "malformed_calls" else ""
                what = f"{name} (tool parser {self.parser}{example})"
            if streak.stop >= bound.stop_steps:
                steps = f" on {streak.stop} consecutive steps" if streak.stop > 1 else ""
                raise HealthStop(
                    f"step {step}: {what} = {value:.4g}, at or above {key}.stop={bound.stop}{steps}: {CAUSES[bound_name]}. The run stops here with a checkpoint; once the cause is fixed (or "
                    f"the bound raised) trainer.resume=auto goes on from it", step=step, key=f"{key}.stop", measure=name,
                    value=value)
            if streak.warn == 0:
                streak.warned = False
            elif streak.warn >= bound.warn_steps and not streak.warned:
                streak.warned = True
                steps = f" on {streak.warn} consecutive steps" if streak.warn > 1 else ""
                self.say(f"warning: step {step}: {what} = {value:.4g}, at or above {key}.warn={bound.warn}{steps}: "
                         f"{CAUSES[bound_name]}")
