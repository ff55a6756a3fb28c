"""Rows to ranks by token count, so that the ranks of a group finish a pass together.

Every rank of an FSDP2 group waits for the slowest at each collective, so a pass costs what the
rank with the most tokens costs. Contiguous shards put a group's long trajectories on one rank;
``assign_rows`` gives each rank the same number of rows (the workers' micro-batches and the
driver's bookkeeping stay simple) and balances their tokens: the longest row first, each to
the rank with the fewest tokens so far that still has room (longest-processing-time-first with
equal counts, as verl balances its data-parallel ranks). Each rank's rows keep their batch order
(the n samples of a prompt that land on one rank still share its forward).

A trajectory trained as several rows (its earlier segments, ``TrainBatch.trajectory_index``)
goes to one rank whole where a rank has room for all its rows, so that the packed forward can
compute the tokens its rows share once; its load is then what its rows' prefix tree computes.
Where no rank has room (a trajectory with more rows than a rank takes, or the last rooms left
smaller) its rows are placed one by one as single rows are: exact either way, the rows on other
ranks only compute their shared tokens again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agentrl.trainer.batch import TrainBatch

__all__ = ["assign_rows", "token_imbalance", "BalancedShards", "balanced_shards"]


def assign_rows(tokens: Sequence[int], world_size: int, units: Sequence[Sequence[int]] | None = None,
                unit_tokens: Sequence[int] | None = None) -> list[list[int]]:
    """Row indices per rank: ``len(tokens) / world_size`` rows each (it must divide), tokens
    balanced greedily (ties: the row first in the batch, the lowest rank). Each list is sorted.

    ``units``: rows to keep on one rank (every row in one unit; default, a unit per row), costing
    ``unit_tokens`` (default, their rows' tokens). A unit goes whole to the least loaded rank
    with room for it; a unit no rank has room for is placed row by row."""
    if world_size < 1 or len(tokens) % world_size:
        raise ValueError(f"{len(tokens)} rows cannot be split evenly over {world_size} ranks")
    units = [[row] for row in range(len(tokens))] if units is None else units
    cost = [sum(tokens[row] for row in unit) for unit in units] if unit_tokens is None else unit_tokens
    per_rank = len(tokens) // world_size
    load, ranks = [0] * world_size, [[] for _ in range(world_size)]

    def place(rows: Sequence[int], weight: int) -> None:
        rank = min((r for r in range(world_size) if len(ranks[r]) + len(rows) <= per_rank), key=lambda r: (load[r], r))
        ranks[rank].extend(rows)
        load[rank] += weight

    for u in sorted(range(len(units)), key=lambda u: (-cost[u], min(units[u]))):
        if any(len(rows) + len(units[u]) <= per_rank for rows in ranks):
            place(units[u], cost[u])
        else:
            for row in sorted(units[u], key=lambda i: (-tokens[i], i)):
                place([row], tokens[row])
    return [sorted(rows) for rows in ranks]


def token_imbalance(tokens: Sequence[int], assignment: Sequence[Sequence[int]]) -> float:
    """The busiest rank's tokens over the mean rank's: 1.0 when the ranks finish together."""
    loads = [sum(tokens[i] for i in rows) for rows in assignment]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class BalancedShards:
    """``shards[r]``: rank r's rows; ``rows[r]``: their indices in the (padded) batch;
    ``imbalance``: ``token_imbalance`` of the assignment."""

    shards: list[TrainBatch]
    rows: list[list[int]]
    size: int  # rows of the batch before padding
    imbalance: float

    def gather(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The ranks' per-row outputs (rank order, ``shards``' row order) back in batch order,
        padding rows dropped."""
        index = torch.tensor([i for rows in self.rows for i in rows], dtype=torch.long)
        stacked = torch.cat(list(parts))
        out = torch.empty_like(stacked)
        out[index] = stacked
        return out[: self.size]


def balanced_shards(batch: TrainBatch, world_size: int) -> BalancedShards:
    """``batch`` padded to a multiple of ``world_size`` rows (loss-free copies of row 0) and
    split over the ranks by ``assign_rows`` on each row's real tokens."""
    extra = (-len(batch)) % world_size
    padded = batch
    if extra:
        filler = batch.select([0] * extra).replace(response_mask=torch.zeros_like(batch.response_mask[:extra]))
        padded = TrainBatch.concat([batch, filler])
    tokens = padded.attention_mask.sum(dim=1).tolist()
    units, unit_tokens = trajectory_units(padded, len(batch))
    rows = assign_rows(tokens, world_size, units, unit_tokens)
    return BalancedShards(
        shards=[padded.select(r) for r in rows], rows=rows, size=len(batch), imbalance=token_imbalance(tokens, rows),
    )


def trajectory_units(batch: TrainBatch, real_rows: int) -> tuple[list[list[int]] | None, list[int] | None]:
    """The rows of each trajectory (``batch.trajectory_index``; rows past ``real_rows`` are
    fillers, each its own) and what each costs: a single row its tokens, several rows their
    prefix tree's nodes and one predicted token per row (a row's tokens counted alike). None, None
    without trajectory indices."""
    if batch.trajectory_index is None:
        return None, None
    from agentrl.trainer.packed import forward_tokens

    by_trajectory: dict[int, list[int]] = {}
    for row, index in enumerate(batch.trajectory_index[:real_rows].tolist()):
        by_trajectory.setdefault(index, []).append(row)
    units = list(by_trajectory.values()) + [[row] for row in range(real_rows, len(batch))]
    tokens = batch.attention_mask.sum(dim=1).tolist()
    cost = [tokens[rows[0]] if len(rows) == 1 else forward_tokens(batch.select(rows), max_tokens=1 << 62).computed + len(rows)
            for rows in units]
    return units, cost
