"""Trajectories to and from parquet, exactly (the rollout file format).

One row per trajectory. Token ids, masks and logprobs are list columns; turns are a list of
structs; free-form values (messages, tool-call arguments, reward info, metrics) are JSON text.
The schema version is stored in the file metadata. Writes are atomic (a temporary file in the
same directory, fsynced, then renamed), so a crash never leaves a partial file behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from agentrl.trajectory import ToolCallRecord, Trajectory, Turn

__all__ = ["SCHEMA_VERSION", "trajectories_to_table", "write_trajectories", "read_trajectories", "StepFiles"]

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


def read_trajectories(path: str | Path) -> Iterator[Trajectory]:
    for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
        for r in batch.to_pylist():
            yield Trajectory(
                row_id=r["row_id"], group_id=r["group_id"], sample_index=r["sample_index"], data_source=r["data_source"],
                agent_name=r["agent_name"], prompt_ids=r["prompt_ids"], response_ids=r["response_ids"],
                response_mask=r["response_mask"], logprobs=r["logprobs"],
                turns=[Turn(x["role"], x["start"], x["end"], x["reward"]) for x in r["turns"]],
                messages=json.loads(r["messages"]), finish_reason=r["finish_reason"], reward=r["reward"],
                reward_info=json.loads(r["reward_info"]),
                tool_calls=[
                    ToolCallRecord(turn=c["turn"], name=c["name"], arguments=json.loads(c["arguments"]), raw=c["raw"],
                                   result=c["result"], error=c["error"], reward=c["reward"], duration_s=c["duration_s"])
                    for c in r["tool_calls"]
                ],
                metrics=json.loads(r["metrics"]), policy_version=r["policy_version"], ground_truth=r["ground_truth"],
            )


class StepFiles:
    """One parquet file per (split, step) under ``root``: what training and validation write."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def write_step(self, step: int, trajectories: Sequence[Trajectory], *, split: str = "train") -> Path:
        return write_trajectories(trajectories, self.root / f"{split}-step{step:06d}.parquet", step=step, split=split)

    def iter_trajectories(self, split: str | None = None) -> Iterator[Trajectory]:
        for path in sorted(self.root.glob(f"{split or '*'}-step*.parquet")):
            yield from read_trajectories(path)
