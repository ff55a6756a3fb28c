"""The step's pure parts: advantages per estimator from real trajectory layouts, metrics, sharding."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from agentrl.config.schema import TrainConfig
from agentrl.trainer.algorithms.masked import masked_whiten
from agentrl.trainer.batch import collate
from agentrl.trainer.step import (
    compute_advantages, mini_batch_starts, pad_rows, share_advantages, shards, trajectory_indices, trajectory_metrics,
    with_earlier_segments,
)
from agentrl.trajectory import ToolCallRecord, Trajectory, TrajectorySegment, Turn


def traj(group: str, sample: int, turns: list[tuple[str, int, float | None]], reward: float, finish: str = "stop") -> Trajectory:
    """turns: (role, length, reward) laid out one after another."""
    ids, mask, spans, pos = [], [], [], 0
    for role, length, r in turns:
        ids += [5] * length
        mask += [1 if role == "assistant" else 0] * length
        spans.append(Turn(role, pos, pos + length, r))
        pos += length
    return Trajectory(
        row_id=group, group_id=group, sample_index=sample, data_source="d", agent_name="tool_agent", prompt_ids=[1, 2],
        response_ids=ids, response_mask=mask, logprobs=[-0.1 * m for m in mask], turns=spans, messages=[],
        finish_reason=finish, reward=reward, metrics={"turns": float(sum(1 for t in turns if t[0] == "assistant")), "tool_calls": 1.0},
    )


def cfg_with(**algorithm) -> TrainConfig:
    return TrainConfig.model_validate({"algorithm": algorithm})


def test_grpo_in_the_step_uses_turn_level_credit():
    trajectories = [
        traj("g", 0, [("assistant", 2, 0.0), ("tool", 2, None), ("assistant", 2, None)], reward=1.0),
        traj("g", 1, [("assistant", 3, None)], reward=0.0),
    ]
    batch = collate(trajectories, pad_token_id=0)
    out, _ = compute_advantages(batch, cfg_with(adv_estimator="grpo", turn_gamma=0.5, grpo_turn_credit=True), kl_coef=None)
    # turn returns: A = [0 + .5*1, 1] = [.5, 1], B = [0]; group mean .5, std .5
    a = out.advantages
    assert_close(a[0, :2], torch.full((2,), 0.0), atol=1e-4, rtol=0)
    assert_close(a[0, 4:6], torch.full((2,), 1.0), atol=1e-4, rtol=0)
    assert_close(a[1, :3], torch.full((3,), -1.0), atol=1e-4, rtol=0)
    assert (a[0, 2:4] == 0).all()  # the tool turn gets nothing


def test_gae_in_the_step_needs_values_and_returns_them():
    trajectories = [traj("g", 0, [("assistant", 3, None)], reward=1.0)]
    batch = collate(trajectories, pad_token_id=0).replace(values=torch.tensor([[0.0, 0.5, 0.0]]))
    out, _ = compute_advantages(batch, cfg_with(adv_estimator="gae", gamma=1.0, lam=1.0), kl_coef=None)
    # raw GAE [1, .5, 1] (returns A + V = 1), whitened over the mask as verl: mean 5/6, unbiased
    # std sqrt(1/12) -> [1/sqrt(3), -2/sqrt(3), 1/sqrt(3)]
    s = 3 ** -0.5
    assert_close(out.advantages, torch.tensor([[s, -2 * s, s]]))
    assert_close(out.returns, torch.ones(1, 3))


def test_kl_in_reward_lowers_the_turn_rewards_by_the_penalty():
    trajectories = [traj("g", 0, [("assistant", 2, None)], reward=1.0), traj("g", 1, [("assistant", 2, None)], reward=1.0)]
    batch = collate(trajectories, pad_token_id=0)
    batch = batch.replace(old_logprobs=torch.tensor([[0.0, 0.0], [0.5, 0.5]]), ref_logprobs=torch.zeros(2, 2))
    out, metrics = compute_advantages(batch, cfg_with(adv_estimator="drgrpo", use_kl_in_reward=True), kl_coef=1.0)
    # k1 penalty: row 0 none, row 1 0.5 per token -> turn rewards 1 and 0 -> Dr.GRPO +-0.5
    assert_close(out.advantages, torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))
    assert metrics["kl/reward_penalty_kl"] == 0.25


def test_rloo_and_reinforce_in_the_step():
    trajectories = [traj("g", 0, [("assistant", 1, None)], reward=1.0), traj("g", 1, [("assistant", 1, None)], reward=0.0)]
    batch = collate(trajectories, pad_token_id=0)
    out, _ = compute_advantages(batch, cfg_with(adv_estimator="rloo"), kl_coef=None)
    assert_close(out.advantages, torch.tensor([[1.0], [-1.0]]))
    out, _ = compute_advantages(batch, cfg_with(adv_estimator="reinforce_plus_plus"), kl_coef=None)
    assert_close(out.advantages, masked_whiten(torch.tensor([[1.0], [0.0]]), torch.ones(2, 1)))


def test_trajectory_metrics_count_turns_tools_errors_and_finishes():
    a = traj("g", 0, [("assistant", 1, 0.5), ("user", 1, None), ("assistant", 1, None)], reward=1.0)
    a.metrics["tool_errors/bad_json"] = 2.0
    b = traj("g", 1, [("assistant", 1, None)], reward=0.0, finish="length")
    m = trajectory_metrics([a, b])
    assert m["reward/mean"] == 0.5 and m["success_rate"] == 0.5
    assert m["turns/mean"] == 1.5 and m["tool_calls/mean"] == 1.0
    assert m["finish/stop"] == 0.5 and m["finish/length"] == 0.5
    assert m["tool_errors/bad_json"] == 2.0
    assert m["turn_reward/mean"] == 0.5
    assert m["retry/second_attempt_success"] == 1.0
    assert m["tool_use_rate"] == 1.0


def test_the_tool_use_rate_is_the_share_of_trajectories_with_a_call_not_the_calls_per_trajectory():
    calls = [3.0, 0.0, 1.0, 0.0]
    trajectories = [traj("g", i, [("assistant", 1, None)], reward=0.0) for i in range(4)]
    for t, n in zip(trajectories, calls):
        t.metrics["tool_calls"] = n
    m = trajectory_metrics(trajectories, prefix="val/")
    assert m["val/tool_use_rate"] == 0.5 and m["val/tool_calls/mean"] == 1.0


def test_earlier_segments_train_with_their_trajectorys_advantage_outside_the_group_statistics():
    a = traj("g", 0, [("assistant", 2, None)], reward=1.0)
    a.earlier_segments = [TrajectorySegment([7, 8, 9], [4, 4, 4, 6], [1, 1, 0, 1], [-0.2, -0.3, 0.0, -0.4],
                                 [Turn("assistant", 0, 2, 0.5), Turn("tool", 2, 3), Turn("assistant", 3, 4)], [5, 5, -1, 6])]
    b = traj("g", 1, [("assistant", 2, None)], reward=0.0)
    c, d = traj("h", 0, [("assistant", 1, None)], reward=0.0), traj("h", 1, [("assistant", 1, None)], reward=0.0)
    rows, parent, blocks = with_earlier_segments([a, b, c, d])
    # each trajectory followed by its segments (adjacent: one micro-batch, one rank, shared tokens)
    assert [r.group_id for r in rows] == ["g", "g#0/segment0", "g", "h", "h"] and parent == [-1, 0, -1, -1, -1]
    assert blocks == [0, 3]  # each group's trajectories and their segments
    assert mini_batch_starts(blocks, 1) == [0, 3] and mini_batch_starts(blocks, 2) == [0]
    assert trajectory_indices(parent).tolist() == [0, 0, 2, 3, 4] and trajectory_indices([-1, -1]) is None
    seg = rows[1]
    assert (seg.prompt_ids, seg.response_ids, seg.response_mask, seg.reward) == ([7, 8, 9], [4, 4, 4, 6], [1, 1, 0, 1], 0.0)
    assert seg.token_versions == [5, 5, -1, 6]  # the segment's own, not its trajectory's
    assert seg.turns[0].reward is None and not seg.earlier_segments  # its turn reward is not counted twice
    cfg = cfg_with(adv_estimator="grpo")
    batch, _ = compute_advantages(collate(rows, pad_token_id=0), cfg, kl_coef=None)
    batch = share_advantages(batch, parent)
    # group g: rewards 1 and 0 -> +-1/sqrt(2) (Bessel's std), the segment's tokens take a's advantage
    a_adv = 2**-0.5
    assert_close(batch.advantages[0, :2], torch.full((2,), a_adv))
    assert_close(batch.advantages[2, :2], torch.full((2,), -a_adv))
    assert_close(batch.advantages[1, :4], torch.tensor([a_adv, a_adv, 0.0, a_adv]))
    assert_close(batch.returns[1, :4], batch.returns[0, 0] * torch.tensor([1.0, 1.0, 0.0, 1.0]))
    # without the segment, the group's advantages are the same: it is outside the statistics
    alone, _ = compute_advantages(collate([a, b, c, d], pad_token_id=0), cfg, kl_coef=None)
    assert_close(alone.advantages[:2, :2], batch.advantages[[0, 2], :2])
    # nothing changes for trajectories without segments: same rows, same order, mini-batches by count
    assert with_earlier_segments([b, c]) == ([b, c], [-1, -1], []) and mini_batch_starts([], 1) == []


def test_every_earlier_segment_of_every_trajectory_takes_its_trajectorys_advantage():
    segment = lambda n: TrajectorySegment([7, 8], [4] * n, [1] * n, [-0.1] * n, [Turn("assistant", 0, n)])  # noqa: E731
    a = traj("g", 0, [("assistant", 2, None)], reward=1.0)
    b = traj("g", 1, [("assistant", 1, None)], reward=0.0)
    c = traj("g", 2, [("assistant", 1, None)], reward=0.5)
    a.earlier_segments, b.earlier_segments = [segment(3), segment(1)], [segment(2)]
    rows, parent, _ = with_earlier_segments([a, b, c])
    assert parent == [-1, 0, 0, -1, 3, -1]
    batch, _ = compute_advantages(collate(rows, pad_token_id=0), cfg_with(adv_estimator="grpo"), kl_coef=None)
    batch = share_advantages(batch, parent)
    own = batch.advantages[[0, 3, 5], 0]  # rewards 1, 0, 0.5: +1, -1, 0 in the group's std
    assert_close(own, torch.tensor([1.0, -1.0, 0.0]))
    for row, trajectory in [(1, 0), (2, 0), (4, 3)]:
        assert_close(batch.advantages[row], own[[0, 3, 5].index(trajectory)] * batch.response_mask[row])


def test_several_data_sources_each_get_success_and_tool_use_and_one_source_adds_nothing():
    trajectories = [traj("g", i, [("assistant", 1, None)], reward=r) for i, r in enumerate([1.0, 0.0, 1.0, 1.0, 0.0])]
    for t, source, calls in zip(trajectories, ["a", "a", "b/after", "b/after", "b/after"], [1.0, 0.0, 0.0, 2.0, 1.0]):
        t.data_source, t.metrics["tool_calls"] = source, calls
    m = trajectory_metrics(trajectories, prefix="val/")
    assert m["val/source/a/success_rate"] == 0.5 and m["val/source/a/tool_use_rate"] == 0.5
    assert m["val/source/b/after/success_rate"] == pytest.approx(2 / 3) and m["val/source/b/after/tool_use_rate"] == pytest.approx(2 / 3)
    assert m["val/success_rate"] == pytest.approx(0.6)
    assert not [k for k in trajectory_metrics(trajectories[:2]) if k.startswith("source/")]


def test_tool_call_metrics_are_averaged_per_tool_name_with_call_counts():
    def call(name: str | None, **metrics: float) -> ToolCallRecord:
        return ToolCallRecord(turn=0, name=name, arguments={}, raw="", result="", metrics=metrics)

    a = traj("g", 0, [("assistant", 1, None)], reward=1.0)
    a.tool_calls = [call("search", hits=3.0, latency=0.5), call("search", hits=1.0), call("calculator")]
    b = traj("g", 1, [("assistant", 1, None)], reward=0.0)
    misspelt = ToolCallRecord(turn=0, name="calculater", arguments={}, raw="", result="", error="unknown_tool")
    b.tool_calls = [call("search", hits=8.0, latency=1.5), call(None), misspelt]
    b.metrics["tool_errors/unknown_tool"] = 1.0  # as the loop counts it
    m = trajectory_metrics([a, b], prefix="val/")
    # search: 3 calls; hits (3 + 1 + 8) / 3 = 4; latency given by 2 calls: (0.5 + 1.5) / 2 = 1
    assert m["val/tool/search/calls"] == 3.0 and m["val/tool/search/hits"] == 4.0 and m["val/tool/search/latency"] == 1.0
    assert m["val/tool/calculator/calls"] == 1.0
    assert not [k for k in m if k.startswith("val/tool/calculator/") and k != "val/tool/calculator/calls"]
    assert not [k for k in m if k.startswith("val/tool/None")]  # the unparsed call has no name to file it under
    # a tool that does not exist is counted under tool_errors/unknown_tool, never as a key of its own
    assert m["val/tool_errors/unknown_tool"] == 1.0 and not [k for k in m if "calculater" in k]


def test_interaction_and_loop_metrics_are_averaged_over_the_trajectories_that_report_them():
    a = traj("g", 0, [("assistant", 1, None)], reward=1.0)
    a.metrics.update({"interaction/attempts": 2.0, "loop/plans": 1.0})
    b = traj("g", 1, [("assistant", 1, None)], reward=0.0)
    b.metrics.update({"interaction/attempts": 5.0})
    c = traj("g", 2, [("assistant", 1, None)], reward=0.0)
    m = trajectory_metrics([a, b, c])
    assert m["interaction/attempts"] == 3.5 and m["loop/plans"] == 1.0


def test_rows_padded_for_sharding_carry_no_loss():
    trajectories = [traj("g", i, [("assistant", 2, None)], reward=float(i)) for i in range(3)]
    batch = collate(trajectories, pad_token_id=0)
    padded = pad_rows(batch, 2)
    assert len(padded) == 4 and padded.response_mask[3].sum() == 0
    parts = shards(batch, 2)
    assert [len(s) for s in parts] == [2, 2]


def test_a_step_without_tokens_to_train_on_is_an_error_naming_the_step_and_the_reasons():
    import dataclasses

    import pytest

    from agentrl.errors import DataError
    from agentrl.trainer.step import usable_trajectories

    ok = traj("g", 0, [("assistant", 2, None)], reward=1.0)
    failed = dataclasses.replace(ok, sample_index=1, finish_reason="loop_error", reward_info={"error": "OSError: no sandbox slot"})
    empty = dataclasses.replace(ok, sample_index=2, response_ids=[], response_mask=[], logprobs=[], turns=[])
    assert usable_trajectories([failed, ok, empty], "step 3") == [ok]
    with pytest.raises(DataError, match=r"step 3: none of the 2 trajectories has tokens to train on \(loop_error: OSError: no sandbox slot; stop: \)"):
        usable_trajectories([failed, empty], "step 3")


def test_infrastructure_failures_stay_out_of_the_loss_counted_by_kind_and_stop_the_run_above_the_rate():
    import dataclasses

    import pytest

    from agentrl.trainer.step import RolloutFailed, failure_metrics, usable_trajectories

    ok = traj("g", 0, [("assistant", 2, None)], reward=1.0)
    # an engine error keeps the tokens sampled before the failure: still left out of the loss
    engine = dataclasses.replace(ok, sample_index=1, finish_reason="engine_error",
                                 reward_info={"error": "http://127.0.0.1:30001/generate: unreachable (ConnectError: refused)"})
    abort = dataclasses.replace(ok, sample_index=2, finish_reason="abort")
    timeout = dataclasses.replace(ok, sample_index=3, finish_reason="trajectory_timeout")  # the policy's budget: trained on
    batch = [ok, engine, abort, timeout]
    assert usable_trajectories(batch, "step 0") == [ok, timeout]
    assert failure_metrics(batch) == {"failures/rate": 0.5, "failures/abort": 1.0, "failures/engine_error": 1.0}
    assert failure_metrics(batch, max_rate=0.5, where="step 4")["failures/rate"] == 0.5  # at the threshold: go on
    with pytest.raises(RolloutFailed) as caught:
        failure_metrics(batch, max_rate=0.25, where="step 4")
    assert str(caught.value) == (
        "step 4: 2 of 4 trajectories failed ({'engine_error': 1, 'abort': 1}), above trainer.max_failure_rate=0.25. "
        "First failure, trajectory g (engine_error):\nhttp://127.0.0.1:30001/generate: unreachable (ConnectError: refused)"
    )
    assert failure_metrics([ok]) == {"failures/rate": 0.0}


def test_the_first_online_step_is_named_step_1_as_the_console_names_it():
    import dataclasses

    import pytest

    from agentrl.config.schema import TrainConfig
    from agentrl.trainer.step import RolloutFailed, TrainingStep

    failed = dataclasses.replace(traj("g", 0, [("assistant", 2, None)], reward=0.0), finish_reason="engine_error", reward_info={"error": "down"})
    with pytest.raises(RolloutFailed, match=r"^step 1: 1 of 1 trajectories failed"):  # before any compute: no groups needed
        TrainingStep(TrainConfig(), None, pad_token_id=0).online([failed], step=0)


def test_a_trajectory_sampled_by_stale_weights_is_an_error_for_on_policy_training():
    import dataclasses

    import pytest

    from agentrl.trainer.step import RolloutFailed, check_weight_versions

    fresh = traj("g", 0, [("assistant", 2, None)], reward=1.0)
    fresh.metrics.update(weight_version_min=3.0, weight_version_max=3.0)
    stale = dataclasses.replace(fresh, sample_index=1, metrics={**fresh.metrics, "weight_version_min": 2.0})
    failed = dataclasses.replace(fresh, sample_index=2, metrics={})  # never reached the engine: nothing to check
    check_weight_versions([fresh, failed], 3, "step 3")
    with pytest.raises(RolloutFailed, match=r"step 3: 1 trajectories were sampled by engine weights older than version 3 "
                                            r"\(first: g, versions 2\.\.3\): a weight sync did not reach every server"):
        check_weight_versions([fresh, stale], 3, "step 3")
