"""The trajectory -> TrainBatch converter: exact padding, reward placement, turn ids."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from agentrl.errors import TrajectoryError
from agentrl.trainer.batch import TrainBatch, collate, collate_sequences
from agentrl.trajectory import Trajectory, TrajectoryBuilder

PAD = 0


def _two_turn_trajectory(group: str = "g0", reward: float = 1.0) -> Trajectory:
    """prompt [11 12 13]; assistant [21 22] (turn reward 0.5); tool [31 32 33]; assistant [41]."""
    b = TrajectoryBuilder([11, 12, 13])
    first = b.append_sampled([21, 22], [-0.1, -0.2])
    first.reward = 0.5
    b.append_observed([31, 32, 33], "tool")
    b.append_sampled([41], [-0.3])
    return _finish(b, group, reward, row="r0")


def _finish(b: TrajectoryBuilder, group: str, reward: float, row: str, sample: int = 0) -> Trajectory:
    return Trajectory(
        row_id=row,
        group_id=group,
        sample_index=sample,
        data_source="test",
        agent_name="tool_agent",
        prompt_ids=b.prompt_ids,
        response_ids=b.response_ids,
        response_mask=b.response_mask,
        logprobs=b.logprobs,
        turns=b.turns,
        messages=[],
        finish_reason="stop",
        reward=reward,
    )


def _one_turn_trajectory(group: str, reward: float) -> Trajectory:
    """prompt [7]; assistant [8 9]."""
    b = TrajectoryBuilder([7])
    b.append_sampled([8, 9], [-1.0, -2.0])
    return _finish(b, group, reward, row="r1")


def test_prompts_are_left_padded_and_responses_right_padded():
    batch = collate([_two_turn_trajectory(), _one_turn_trajectory("g1", 0.0)], pad_token_id=PAD)
    assert batch.prompt_length == 3 and batch.response_length == 6
    assert batch.input_ids.tolist() == [
        [11, 12, 13, 21, 22, 31, 32, 33, 41],
        [PAD, PAD, 7, 8, 9, PAD, PAD, PAD, PAD],
    ]
    assert batch.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 0, 0, 0, 0],
    ]
    assert batch.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7, 8],
        [0, 0, 0, 1, 2, 2, 2, 2, 2],
    ]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0]]
    assert_close(batch.engine_logprobs, torch.tensor([[-0.1, -0.2, 0, 0, 0, -0.3], [-1.0, -2.0, 0, 0, 0, 0]]))


def test_turn_reward_sits_on_the_last_token_of_its_turn_and_the_trajectory_reward_on_the_last_sampled_token():
    batch = collate([_two_turn_trajectory(reward=1.0), _one_turn_trajectory("g1", 0.25)], pad_token_id=PAD)
    assert_close(
        batch.token_rewards,
        torch.tensor([[0.0, 0.5, 0, 0, 0, 1.0], [0.0, 0.25, 0, 0, 0, 0]]),
    )
    assert_close(batch.turn_rewards, torch.tensor([[0.5, 1.0], [0.25, 0.0]]))
    assert batch.num_turns.tolist() == [2, 1]
    assert_close(batch.scores, torch.tensor([1.0, 0.25]))


def test_trajectory_reward_skips_trailing_observation_tokens():
    b = TrajectoryBuilder([5])
    b.append_sampled([6, 7], [-0.5, -0.5])
    b.append_observed([8, 9], "user")  # e.g. an interaction's final reply
    batch = collate([_finish(b, "g", 2.0, row="r")], pad_token_id=PAD)
    assert batch.token_rewards.tolist() == [[0.0, 2.0, 0.0, 0.0]]


def test_turn_ids_number_assistant_turns_and_mark_other_tokens_minus_one():
    batch = collate([_two_turn_trajectory(), _one_turn_trajectory("g1", 0.0)], pad_token_id=PAD)
    assert batch.turn_ids.tolist() == [[0, 0, -1, -1, -1, 1], [0, 0, -1, -1, -1, -1]]


def test_group_index_follows_first_appearance_of_group_ids():
    trajs = [_one_turn_trajectory(g, 0.0) for g in ("b", "a", "b", "c", "a")]
    assert collate(trajs, pad_token_id=PAD).group_index.tolist() == [0, 1, 0, 2, 1]


def test_turn_spans_that_do_not_tile_the_response_are_rejected_naming_the_trajectory():
    traj = _two_turn_trajectory()
    traj.turns[2].start = 6  # leaves token 5 in no turn
    with pytest.raises(TrajectoryError, match=r"trajectory r0#0: turn 2 spans \[6, 6\) but the previous turn ended at 5"):
        collate([traj], pad_token_id=PAD)


def test_response_longer_than_the_limit_is_an_error_not_a_truncation():
    with pytest.raises(TrajectoryError, match="r0#0: response has 6 tokens, more than data.max_response_length = 5"):
        collate([_two_turn_trajectory()], pad_token_id=PAD, max_response_length=5)


def test_mask_that_disagrees_with_the_turn_role_is_rejected():
    traj = _two_turn_trajectory()
    traj.response_mask[3] = 1  # a tool token claiming to be sampled
    with pytest.raises(TrajectoryError, match=r"turn 1 \(tool\) has response_mask values other than 0"):
        collate([traj], pad_token_id=PAD)


def test_split_shard_and_concat_round_trip():
    trajs = [_one_turn_trajectory(f"g{i}", float(i)) for i in range(4)] + [_two_turn_trajectory()] * 2
    batch = collate(trajs, pad_token_id=PAD)
    parts = batch.split(4)
    assert [len(p) for p in parts] == [4, 2]
    shards = [batch.shard(r, 2) for r in range(2)]
    assert shards[1].scores.tolist() == batch.scores[3:].tolist()
    again = TrainBatch.concat(shards)
    assert all(torch.equal(a, b) for a, b in zip(again.tensors().values(), batch.tensors().values()))
    with pytest.raises(ValueError, match="6 rows cannot be sharded evenly over 4 ranks"):
        batch.shard(0, 4)


def test_trim_drops_all_padding_columns_and_keeps_the_prompt_boundary():
    batch = collate([_two_turn_trajectory(), _one_turn_trajectory("g1", 0.0)], pad_token_id=PAD)
    short = batch.select([1]).replace(values=torch.arange(6.0).unsqueeze(0)).trim()
    assert short.input_ids.tolist() == [[7, 8, 9]]
    assert short.prompt_length == 1 and short.response_length == 2
    assert short.values.tolist() == [[0.0, 1.0]]
    assert short.position_ids.tolist() == [[0, 1, 2]]


def test_collate_sequences_keeps_the_given_loss_mask_for_sft():
    batch = collate_sequences([[1, 2]], [[3, 4, 5]], [[0, 1, 1]], pad_token_id=PAD)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5]]
    assert batch.response_mask.tolist() == [[0, 1, 1]]


def test_split_never_ends_a_micro_batch_inside_a_trajectorys_rows():
    rows = 7
    batch = collate_sequences([[1, 2]] * rows, [[3, 4]] * rows, [[1, 1]] * rows, pad_token_id=PAD)
    # trajectories: row 0 alone; rows 1-4 (a trajectory and its three earlier segments); 5 and 6 alone
    batch = batch.replace(trajectory_index=torch.tensor([0, 1, 1, 1, 1, 5, 6]))
    assert [len(m) for m in batch.split(2)] == [5, 2]  # the chunk at row 2 would have cut trajectory 1
    assert [m.trajectory_index.tolist() for m in batch.split(3)] == [[0, 1, 1, 1, 1], [5, 6]]
    assert [len(m) for m in batch.split(1)] == [1, 4, 1, 1]
    assert [len(m) for m in batch.replace(trajectory_index=None).split(2)] == [2, 2, 2, 1]  # rows of their own
