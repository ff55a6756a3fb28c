"""The version-1 rollout file format (what agentrl 0.1's ``agentrl train`` and ``agentrl
rollout`` wrote, one parquet file per step), kept only to produce such files for the
compatibility test: ``RolloutStore`` (version 2) still reads them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from agentrl.trajectory import Trajectory

__all__ = ["SCHEMA_VERSION", "write_trajectories"]

SCHEMA_VERSION = "1"


def _row(t: Trajectory, step: int, split: str) -> dict[str, Any]:
    return {
        "step": step, "split": split, "row_id": t.row_id, "group_id": t.group_id, "sample_index": t.sample_index,
        "data_source": t.data_source, "agent_name": t.agent_name, "prompt_ids": t.prompt_ids,
        "response_ids": t.response_ids, "response_mask": t.response_mask, "logprobs": t.logprobs,
        "turns": [{"role": x.role, "start": x.start, "end": x.end, "reward": x.reward} for x in t.turns],
        "messages": json.dumps(t.messages), "finish_reason": t.finish_reason, "reward": float(t.reward),
        "reward_info": json.dumps(t.reward_info, default=str),
        "tool_calls": [
            {"turn": c.turn, "name": c.name, "arguments": json.dumps(c.arguments), "raw": c.raw, "result": c.result,
             "error": c.error, "reward": c.reward, "duration_s": c.duration_s}
            for c in t.tool_calls
        ],
        "metrics": json.dumps(t.metrics), "policy_version": t.policy_version, "ground_truth": t.ground_truth,
    }


_TURN = pa.struct([("role", pa.string()), ("start", pa.int64()), ("end", pa.int64()), ("reward", pa.float64())])
_CALL = pa.struct([("turn", pa.int64()), ("name", pa.string()), ("arguments", pa.string()), ("raw", pa.string()),
                   ("result", pa.string()), ("error", pa.string()), ("reward", pa.float64()), ("duration_s", pa.float64())])
SCHEMA = pa.schema([
    ("step", pa.int64()), ("split", pa.string()), ("row_id", pa.string()), ("group_id", pa.string()),
    ("sample_index", pa.int64()), ("data_source", pa.string()), ("agent_name", pa.string()),
    ("prompt_ids", pa.list_(pa.int64())), ("response_ids", pa.list_(pa.int64())), ("response_mask", pa.list_(pa.int8())),
    ("logprobs", pa.list_(pa.float64())), ("turns", pa.list_(_TURN)), ("messages", pa.string()),
    ("finish_reason", pa.string()), ("reward", pa.float64()), ("reward_info", pa.string()), ("tool_calls", pa.list_(_CALL)),
    ("metrics", pa.string()), ("policy_version", pa.int64()), ("ground_truth", pa.string()),
], metadata={"agentrl_schema_version": SCHEMA_VERSION})


def trajectories_to_table(trajectories: Sequence[Trajectory], *, step: int = 0, split: str = "train") -> pa.Table:
    return pa.Table.from_pylist([_row(t, step, split) for t in trajectories], schema=SCHEMA)


def write_trajectories(trajectories: Sequence[Trajectory], path: str | Path, *, step: int = 0, split: str = "train") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        pq.write_table(trajectories_to_table(trajectories, step=step, split=split), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
