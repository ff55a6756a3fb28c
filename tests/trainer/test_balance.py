"""Rows to ranks by token count (``balance.py``), with hand-computed assignments."""

from __future__ import annotations

import pytest
import torch

from agentrl.trainer.balance import assign_rows, balanced_shards, token_imbalance
from agentrl.trainer.batch import collate_sequences


def test_longest_first_to_the_lightest_rank_with_room():
    # sorted: row0 (5) r0, row2 (4) r1, row4 (3) r1=7, row5 (3) r0=8, row3 (2) r1=9 (full), row1 (1) r0=9
    tokens = [5, 1, 4, 2, 3, 3]
    assert assign_rows(tokens, 2) == [[0, 1, 5], [2, 3, 4]]
    assert token_imbalance(tokens, [[0, 1, 5], [2, 3, 4]]) == 1.0
    assert token_imbalance(tokens, [[0, 1, 2], [3, 4, 5]]) == pytest.approx(10 / 9)  # contiguous shards


def test_three_ranks_equal_counts_and_ties():
    # sorted: row1 (8) r0=8, row4 (7) r1=7, row0 (2) r2=2, row3 (2) r2=4 (full),
    # row2 (1) r1=8 (lighter than r0), row5 (1) r0=9: loads 9, 8, 4
    tokens = [2, 8, 1, 2, 7, 1]
    rows = assign_rows(tokens, 3)
    assert rows == [[1, 5], [2, 4], [0, 3]]
    assert token_imbalance(tokens, rows) == pytest.approx(9 / 7)


def test_rows_must_divide():
    with pytest.raises(ValueError, match="5 rows cannot be split evenly over 2 ranks"):
        assign_rows([1] * 5, 2)


def test_balanced_shards_pad_assign_and_gather_back():
    # real tokens per row: prompt + response = 2+4, 1+1, 3+2 (one padding row: a copy of row 0, 6 tokens)
    batch = collate_sequences([[5, 6], [7], [8, 9, 10]], [[11, 12, 13, 14], [15], [16, 17]], [[1] * 4, [1], [1, 1]],
                              pad_token_id=0)
    split = balanced_shards(batch, 2)
    # tokens [6, 2, 5, 6]: row0 r0=6, row3 r1=6, row2 (tie: the lower rank) r0=11, row1 r1=8
    assert split.rows == [[0, 2], [1, 3]]
    assert split.imbalance == pytest.approx(11 / 9.5)
    assert split.shards[1].response_mask[1].sum() == 0  # the padding row trains nothing
    assert torch.equal(split.shards[0].input_ids, batch.input_ids[[0, 2]])
    per_row = [shard.input_ids[:, -1:].float() for shard in split.shards]  # any per-row output
    assert torch.equal(split.gather(per_row), batch.input_ids[:, -1:].float())


def test_a_trajectorys_rows_go_to_one_rank_when_one_has_room_else_row_by_row():
    tokens = [5, 1, 4, 2, 3, 3]
    # rows 0, 1, 2 are one trajectory (cost 7): whole to rank 0; then 4 (3) r1, 5 (3) r1, 3 (2) r1
    assert assign_rows(tokens, 2, [[0, 1, 2], [3], [4], [5]], [7, 2, 3, 3]) == [[0, 1, 2], [3, 4, 5]]
    # four rows cannot go whole to a rank of three: placed (first, the dearest unit) as single rows
    # are: row0 (5) r0, row2 (4) r1, row3 (2) r1=6, row1 (1) r0=6; then row4 (3) r0=9, row5 (3) r1=9
    assert assign_rows(tokens, 2, [[0, 1, 2, 3], [4], [5]], [9, 3, 3]) == [[0, 1, 4], [2, 3, 5]]


def test_balanced_shards_keep_a_trajectory_and_its_segments_on_one_rank():
    # row 0 and its earlier segment (row 2, whose prompt holds row 0's prompt) share a trajectory
    batch = collate_sequences([[5, 6], [7], [5, 6, 11, 12]], [[11, 12, 13, 14], [15], [16, 17]], [[1] * 4, [1], [1, 1]],
                              pad_token_id=0)
    # by tokens alone (rows 6, 2, 6 and the filler, a copy of row 0, 6): rows 0 and 2 apart
    assert balanced_shards(batch, 2).rows == [[0, 3], [1, 2]]
    together = balanced_shards(batch.replace(trajectory_index=torch.tensor([0, 1, 0])), 2)
    # the trajectory (a tree of 4 shared + 1 + 1 tokens, one predicted per row: 8) to rank 0; the
    # filler (a unit of its own, not of row 0's trajectory) and row 1 to rank 1
    assert together.rows == [[0, 2], [1, 3]]
    swapped = balanced_shards(batch.replace(trajectory_index=torch.tensor([0, 1, 1])), 2)
    assert swapped.rows == [[1, 2], [0, 3]]  # rows 1 and 2 (nothing shared: 1 + 5 + 2 = 8) together
