"""``RolloutStore``: trajectories in parquet shards, one per (split, step, writer).

Layout: ``<root>/<split>-step<step:06d>-w<writer:03d>.parquet``. One row per trajectory:

* token ids, the response mask and the logprobs are list columns; turns and tool calls are
  lists of structs;
* free-form values (messages, reward info, metrics, tool-call arguments) are JSON text, since
  they differ from row to row and Arrow structs need one schema for all;
* ``row`` is the dataset row as JSON (prompt, data_source, reward_model, extra_info,
  agent_name), so a trajectory can be re-run through its agent loop without the dataset.

The schema version sits in each file's metadata (``agentrl_schema_version``). Version 1 (the
files agentrl 0.1 wrote, one per step: no ``writer_id`` and no ``row``) is read too, and files
before version 4 read with no ``earlier_segments``, before version 5 with no ``token_versions`` (the
weight version of each response token: an empty list, unknown), before version 6 with no
``dropped`` (every trajectory of a training step read as trained), before version 7 with no
``role`` (a single-agent trajectory).

``dropped`` says why a stored trajectory's group was not trained (null: it was, or its split does
not train): ``stale``, a group an asynchronous run finished and dropped as older than
``rollout.max_staleness`` (stored in the shard of the step that dropped it, beside the groups that
step trained), or ``filtered``, a group dynamic sampling (``algorithm.filter_groups``) drew and did
not train. ``TrajectoryFilter(dropped=False)`` reads what was trained.

A shard is written to a hidden temporary file in the same directory in row groups, fsynced,
then renamed over its final name (and the directory fsynced), so a reader sees a whole shard
or none, and a crash mid-write leaves the earlier shards as they were. Readers skip hidden
files. Reading streams record batches through ``pyarrow.dataset`` with the filters pushed
down (files outside the step range are not even opened).

A run resumed from an earlier checkpoint trains the steps after it again: ``set_aside_after``
moves the shards of those steps (a killed run's, of a training that no longer exists) into
``<root>/superseded/<time>/`` with a ``superseded.json`` saying when and why, so that readers,
which read the shards directly under ``root`` only, see one set of trajectories a step.

JSON values round-trip exactly when they are JSON values (dicts with string keys, lists,
strings, numbers, booleans, None; floats including NaN and infinities); anything else in
``reward_info`` is stored as its ``str``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from agentrl.data.row import Row
from agentrl.errors import DataError
from agentrl.rundir import utc_stamp
from agentrl.trajectory import ToolCallRecord, Trajectory, TrajectoryFinish, TrajectorySegment, Turn

if TYPE_CHECKING:  # pyarrow.dataset (and the pandas it imports, ~0.5 s) loads when a store is read
    import pyarrow.dataset as ds

__all__ = ["SCHEMA_VERSION", "SCHEMA", "READABLE_VERSIONS", "DROPPED_REASONS", "RolloutStore", "StoredTrajectory", "TrajectoryFilter",
           "trajectories_to_table", "shard_name"]

SCHEMA_VERSION = "7"  # 3: each tool call's metrics; 4: earlier segments; 5: token versions; 6: dropped groups; 7: roles
READABLE_VERSIONS = ("1", "2", "3", "4", "5", "6", "7")
# why a stored group was not trained (the ``dropped`` column): stale (an asynchronous run's, older
# than rollout.max_staleness), filtered (dynamic sampling's: its rewards all equal, or beyond the batch)
DROPPED_REASONS = ("stale", "filtered")
VERSION_KEY = b"agentrl_schema_version"

_TURN = pa.struct([("role", pa.string()), ("start", pa.int64()), ("end", pa.int64()), ("reward", pa.float64())])
_CALL = pa.struct([("turn", pa.int64()), ("name", pa.string()), ("arguments", pa.string()), ("raw", pa.string()),
                   ("result", pa.string()), ("error", pa.string()), ("reward", pa.float64()), ("duration_s", pa.float64()),
                   ("metrics", pa.string())])
_SEGMENT = pa.struct([("prompt_ids", pa.list_(pa.int64())), ("response_ids", pa.list_(pa.int64())),
                      ("response_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float64())), ("turns", pa.list_(_TURN)),
                      ("token_versions", pa.list_(pa.int64()))])
SCHEMA = pa.schema(
    [
        ("step", pa.int64()), ("split", pa.string()), ("writer_id", pa.int64()),
        ("row_id", pa.string()), ("group_id", pa.string()), ("sample_index", pa.int64()),
        ("data_source", pa.string()), ("agent_name", pa.string()),
        ("prompt_ids", pa.list_(pa.int64())), ("response_ids", pa.list_(pa.int64())),
        ("response_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float64())),
        ("turns", pa.list_(_TURN)), ("messages", pa.string()), ("finish_reason", pa.string()),
        ("reward", pa.float64()), ("reward_info", pa.string()), ("tool_calls", pa.list_(_CALL)),
        ("metrics", pa.string()), ("policy_version", pa.int64()), ("ground_truth", pa.string()),
        ("row", pa.string()),  # the dataset row as JSON; null when the writer did not have it
        ("earlier_segments", pa.list_(_SEGMENT)),  # Trajectory.earlier_segments (none before version 4)
        ("token_versions", pa.list_(pa.int64())),  # Trajectory.token_versions (none before version 5)
        ("dropped", pa.string()),  # why its group was not trained (null: trained; none before version 6)
        ("role", pa.string()),  # Trajectory.role (null: a single agent; none before version 7)
    ],
    metadata={VERSION_KEY: SCHEMA_VERSION.encode()},
)

_SHARD = re.compile(r"^(?P<split>[^.]+?)-step(?P<step>\d+)(?:-w(?P<writer>\d+))?\.parquet$")


def shard_name(split: str, step: int, writer_id: int) -> str:
    return f"{split}-step{step:06d}-w{writer_id:03d}.parquet"


@dataclass(frozen=True, slots=True)
class TrajectoryFilter:
    """Which trajectories to read. ``steps`` is ``(first, stop)``: ``first <= step < stop``,
    either end open when None. Names may be one value or several."""

    split: str | Sequence[str] | None = None
    steps: tuple[int | None, int | None] | None = None
    data_source: str | Sequence[str] | None = None
    finish_reason: str | Sequence[str] | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    dropped: bool | None = None  # True: only groups dropped untrained; False: only the rest; None: both

    def __post_init__(self) -> None:
        # a misspelt reason would select nothing, silently: refuse it, listing the known ones
        reasons = [self.finish_reason] if isinstance(self.finish_reason, str) else self.finish_reason or []
        for reason in reasons:
            TrajectoryFinish.parse(reason, where="TrajectoryFilter.finish_reason")

    def expression(self) -> ds.Expression | None:
        import pyarrow.compute as pc  # when a store is read: a run that writes one (or none) does not load it

        parts: list[ds.Expression] = []
        for column, value in (("split", self.split), ("data_source", self.data_source), ("finish_reason", self.finish_reason)):
            if value is not None:
                values = [value] if isinstance(value, str) else list(value)
                parts.append(pc.field(column).isin(values))
        first, stop = self.steps or (None, None)
        if first is not None:
            parts.append(pc.field("step") >= first)
        if stop is not None:
            parts.append(pc.field("step") < stop)
        if self.min_reward is not None:
            parts.append(pc.field("reward") >= self.min_reward)
        if self.max_reward is not None:
            parts.append(pc.field("reward") <= self.max_reward)
        if self.dropped is not None:
            parts.append(pc.field("dropped").is_valid() if self.dropped else pc.field("dropped").is_null())
        if not parts:
            return None
        expr = parts[0]
        for part in parts[1:]:
            expr = expr & part
        return expr

    def may_hold(self, split: str, step: int) -> bool:
        """False when a shard of this (split, step) cannot hold a match (its file is skipped)."""
        if self.split is not None and split not in ([self.split] if isinstance(self.split, str) else self.split):
            return False
        first, stop = self.steps or (None, None)
        return (first is None or step >= first) and (stop is None or step < stop)


@dataclass(slots=True)
class StoredTrajectory:
    """A trajectory with where it was stored and, when the writer had it, its dataset row."""

    split: str
    step: int
    writer_id: int
    trajectory: Trajectory
    row: Row | None
    dropped: str | None = None  # why its group was not trained (``DROPPED_REASONS``); None: trained

    @property
    def session_id(self) -> str:
        """The id its agent loop gave the engine: ``<row_id>#<sample_index>``."""
        return f"{self.trajectory.row_id}#{self.trajectory.sample_index}"


# ----------------------------------------------------------------------------- encoding


def _encode(t: Trajectory, step: int, split: str, writer_id: int, row: Row | None, dropped: str | None) -> dict[str, Any]:
    return {
        "step": step, "split": split, "writer_id": writer_id, "row_id": t.row_id, "group_id": t.group_id,
        "sample_index": t.sample_index, "data_source": t.data_source, "agent_name": t.agent_name,
        "prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "response_mask": t.response_mask, "logprobs": t.logprobs,
        "turns": [_encode_turn(x) for x in t.turns],
        "messages": json.dumps(t.messages), "finish_reason": t.finish_reason.value, "reward": float(t.reward),
        "reward_info": json.dumps(t.reward_info, default=str),
        "tool_calls": [
            {"turn": c.turn, "name": c.name, "arguments": json.dumps(c.arguments), "raw": c.raw, "result": c.result,
             "error": c.error, "reward": c.reward, "duration_s": c.duration_s,
             "metrics": json.dumps(c.metrics)}
            for c in t.tool_calls
        ],
        "metrics": json.dumps(t.metrics), "policy_version": t.policy_version, "ground_truth": t.ground_truth,
        "row": None if row is None else row.model_dump_json(),
        "earlier_segments": [
            {"prompt_ids": g.prompt_ids, "response_ids": g.response_ids, "response_mask": g.response_mask,
             "logprobs": g.logprobs, "turns": [_encode_turn(x) for x in g.turns], "token_versions": g.token_versions}
            for g in t.earlier_segments
        ],
        "token_versions": t.token_versions,
        "dropped": dropped,
        "role": t.role,
    }


def _encode_turn(x: Turn) -> dict[str, Any]:
    return {"role": x.role, "start": x.start, "end": x.end, "reward": x.reward}


def _decode_turn(x: dict[str, Any]) -> Turn:
    return Turn(x["role"], x["start"], x["end"], x["reward"])


def _decode(r: dict[str, Any]) -> Trajectory:
    return Trajectory(
        row_id=r["row_id"], group_id=r["group_id"], sample_index=r["sample_index"], data_source=r["data_source"],
        agent_name=r["agent_name"], prompt_ids=r["prompt_ids"], response_ids=r["response_ids"],
        response_mask=r["response_mask"], logprobs=r["logprobs"],
        turns=[_decode_turn(x) for x in r["turns"]],
        messages=json.loads(r["messages"]), finish_reason=r["finish_reason"], reward=r["reward"],
        reward_info=json.loads(r["reward_info"]),
        tool_calls=[
            ToolCallRecord(turn=c["turn"], name=c["name"], arguments=json.loads(c["arguments"]), raw=c["raw"],
                           result=c["result"], error=c["error"], reward=c["reward"], duration_s=c["duration_s"],
                           metrics=json.loads(c.get("metrics") or "{}"))  # none before schema version 3
            for c in r["tool_calls"]
        ],
        metrics=json.loads(r["metrics"]), policy_version=r["policy_version"], ground_truth=r["ground_truth"],
        earlier_segments=[
            TrajectorySegment(g["prompt_ids"], g["response_ids"], g["response_mask"], g["logprobs"],
                              [_decode_turn(x) for x in g["turns"]], g.get("token_versions") or [])
            for g in r.get("earlier_segments") or []  # none before schema version 4
        ],
        token_versions=r.get("token_versions") or [],  # none before schema version 5
        role=r.get("role"),  # none before schema version 7
    )


def trajectories_to_table(
    trajectories: Sequence[Trajectory], *, step: int = 0, split: str = "train", writer_id: int = 0,
    rows: Mapping[str, Row] | None = None, dropped: Mapping[str, str] | None = None,
) -> pa.Table:
    rows, dropped = rows or {}, dropped or {}
    return pa.Table.from_pylist([_encode(t, step, split, writer_id, rows.get(t.row_id), dropped.get(t.group_id))
                                 for t in trajectories], schema=SCHEMA)


def _rows_by_id(rows: Mapping[str, Row] | Iterable[tuple[str, Row]] | None) -> dict[str, Row]:
    if rows is None:
        return {}
    return dict(rows.items()) if isinstance(rows, Mapping) else dict(rows)


# ----------------------------------------------------------------------------- the store


class RolloutStore:
    """Parquet shards under ``root``; written by the trainer and ``agentrl rollout``, read by replay."""

    def __init__(self, root: str | Path, *, row_group_size: int = 256):
        self.root = Path(root)
        self.row_group_size = row_group_size  # trajectories per row group (what is converted at once)

    # ------------------------------------------------------------------ writing
    def write_step(
        self,
        step: int,
        trajectories: Sequence[Trajectory],
        *,
        split: str = "train",
        writer_id: int = 0,
        rows: Mapping[str, Row] | Iterable[tuple[str, Row]] | None = None,
        dropped: Mapping[str, str] | None = None,
    ) -> Path:
        """Write one shard atomically; ``rows`` (by row id, or ``(row_id, row)`` pairs as the
        runner takes them) are stored with their trajectories so a re-run needs no dataset;
        ``dropped`` (group id -> one of ``DROPPED_REASONS``) marks the groups stored untrained."""
        if not re.fullmatch(r"[A-Za-z0-9_]+", split):
            raise ValueError(f"split must be letters, digits or '_', got {split!r}")
        unknown = sorted({reason for reason in (dropped or {}).values() if reason not in DROPPED_REASONS})
        if unknown:
            raise ValueError(f"dropped: unknown reason(s) {unknown} (known: {', '.join(DROPPED_REASONS)})")
        if step < 0 or writer_id < 0:
            raise ValueError(f"step and writer_id must be >= 0, got step={step}, writer_id={writer_id}")
        by_id = _rows_by_id(rows)
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / shard_name(split, step, writer_id)
        for stale in self.root.glob(f".{path.name}.tmp-*"):  # left by a writer that crashed on this shard
            stale.unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                with pq.ParquetWriter(f, SCHEMA) as writer:
                    for i in range(0, max(len(trajectories), 1), self.row_group_size):
                        chunk = trajectories[i : i + self.row_group_size]
                        writer.write_table(trajectories_to_table(chunk, step=step, split=split, writer_id=writer_id,
                                                                 rows=by_id, dropped=dropped))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.root)  # the rename itself survives a power loss
        return path

    def set_aside_after(self, step: int, *, reason: str) -> list[Path]:
        """Move the shards of every split with a step after ``step`` to a new
        ``superseded/<UTC time>/`` directory (and write its ``superseded.json``: time, reason,
        step, the shards' names); returns their new paths, none when there were none. Files whose
        name is not a shard's stay."""
        if not self.root.is_dir():
            return []
        later = [p for p in sorted(self.root.glob("*.parquet"))
                 if (m := _SHARD.match(p.name)) is not None and not p.name.startswith((".", "_")) and int(m["step"]) > step]
        if not later:
            return []
        at = utc_stamp()
        aside = self.root / "superseded" / at.replace(":", "")
        suffix = 1
        while aside.exists():  # two resumes in one second
            aside = aside.with_name(f"{at.replace(':', '')}-{suffix}")
            suffix += 1
        aside.mkdir(parents=True)
        (aside / "superseded.json").write_text(json.dumps(
            {"superseded_at": at, "superseded_reason": reason, "after_step": step, "shards": [p.name for p in later]}, indent=2))
        moved = []
        for path in later:
            os.replace(path, aside / path.name)
            moved.append(aside / path.name)
        _fsync_dir(self.root)
        return moved

    # ------------------------------------------------------------------ reading
    def shards(self, where: TrajectoryFilter | None = None) -> list[Path]:
        """The visible shard files (hidden temporaries excluded), skipping those whose name
        shows they hold no match."""
        if not self.root.is_dir():
            raise DataError("no rollout store here (not a directory)", file=str(self.root))
        found = []
        for path in sorted(self.root.glob("*.parquet")):
            if path.name.startswith((".", "_")):
                continue
            m = _SHARD.match(path.name)
            if m is not None and where is not None and not where.may_hold(m["split"], int(m["step"])):
                continue
            found.append(path)
        return found

    def _dataset(self, paths: Sequence[Path]) -> ds.Dataset:
        for path in paths:
            version = (pq.read_schema(path).metadata or {}).get(VERSION_KEY, b"").decode()
            if version not in READABLE_VERSIONS:
                raise DataError(
                    f"schema version {version or '(none)'} is not one this agentrl reads ({', '.join(READABLE_VERSIONS)})",
                    file=str(path), field="agentrl_schema_version",
                )
        # an explicit schema: columns a version-1 file lacks (writer_id, row) read as null
        import pyarrow.dataset as ds

        return ds.dataset([str(p) for p in paths], schema=SCHEMA, format="parquet")

    def read_table(
        self, columns: Sequence[str] | None = None, filters: TrajectoryFilter | ds.Expression | None = None
    ) -> pa.Table:
        """The matching rows as one Arrow table (pick ``columns`` to keep it small)."""
        where = filters if isinstance(filters, TrajectoryFilter) else None
        expression = where.expression() if where is not None else filters
        dataset = self._dataset(self.shards(where))
        return dataset.to_table(columns=list(columns) if columns is not None else None, filter=expression)

    def iter_stored(
        self, where: TrajectoryFilter | None = None, *, limit: int | None = None, batch_size: int = 256
    ) -> Iterator[StoredTrajectory]:
        """Matching trajectories in (file, row) order, streamed one record batch at a time."""
        return _scan(self._dataset(self.shards(where)), where, limit, batch_size)

    def iter_shard(self, path: str | Path, where: TrajectoryFilter | None = None) -> Iterator[StoredTrajectory]:
        """The (matching) trajectories of one shard file."""
        return _scan(self._dataset([Path(path)]), where, None, 256)

    def iter_trajectories(self, where: TrajectoryFilter | None = None, *, limit: int | None = None, **filters: Any) -> Iterator[Trajectory]:
        """Matching trajectories; filters as a ``TrajectoryFilter`` or as its keyword fields,
        e.g. ``store.iter_trajectories(steps=(2, 5), finish_reason="stop")``."""
        if filters:
            if where is not None:
                raise TypeError("pass either a TrajectoryFilter or filter keywords, not both")
            where = TrajectoryFilter(**filters)
        for stored in self.iter_stored(where, limit=limit):
            yield stored.trajectory

    def steps(self, split: str | None = None) -> list[int]:
        """The steps present (of one split, or of all)."""
        table = self.read_table(["step"], TrajectoryFilter(split=split))
        return sorted(set(table.column("step").to_pylist()))


def _scan(dataset: ds.Dataset, where: TrajectoryFilter | None, limit: int | None, batch_size: int) -> Iterator[StoredTrajectory]:
    if limit is not None and limit <= 0:
        return
    count = 0
    expression = where.expression() if where is not None else None
    for batch in dataset.scanner(filter=expression, batch_size=batch_size).to_batches():
        for r in batch.to_pylist():
            row = Row.model_validate_json(r["row"]) if r["row"] is not None else None
            writer = r["writer_id"] if r["writer_id"] is not None else 0
            yield StoredTrajectory(split=r["split"], step=r["step"], writer_id=writer, trajectory=_decode(r), row=row,
                                   dropped=r.get("dropped"))
            count += 1
            if limit is not None and count >= limit:
                return


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
