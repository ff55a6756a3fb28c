"""RolloutStore: exact round trips, filters pushed down, atomic shards, older files read."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from replay_data import SCRIPT
from v1_format import write_trajectories

from agentrl.errors import DataError, TrajectoryError
from agentrl.data.rollout_store import SCHEMA_VERSION, RolloutStore, TrajectoryFilter, shard_name, trajectories_to_table
from agentrl.trajectory import ToolCallRecord, Trajectory, TrajectoryFinish, TrajectorySegment, Turn


def odd_trajectory(**changes) -> Trajectory:
    """Every field set, with the values a codec gets wrong: None, unicode, nested JSON, -0.0."""
    t = Trajectory(
        row_id="row é/1", group_id="train3/0:row", sample_index=2, data_source="src", agent_name="tool_agent",
        prompt_ids=[1, 2, 3], response_ids=[7, 8, 9, 10], response_mask=[1, 1, 0, 0], logprobs=[-0.125, -1e-9, 0.0, -0.0],
        turns=[Turn("assistant", 0, 2, None), Turn("tool", 2, 3), Turn("assistant", 3, 3, 0.25)],
        messages=[{"role": "user", "content": "ünï ✓"}, {"role": "assistant", "content": "", "tool_calls": [{"a": [1, None]}]}],
        finish_reason="max_assistant_turns", reward=-0.5,
        reward_info={"nested": {"x": [1.5, "y", None, True]}, "inf": math.inf},
        tool_calls=[ToolCallRecord(turn=0, name=None, arguments=None, raw="{bad", result="error: bad json", error="bad_json"),
                    ToolCallRecord(turn=0, name="calculator", arguments={"expression": "1+1", "k": [1, {"z": None}]},
                                   raw="...", result="2", reward=0.5, duration_s=0.001, metrics={"exit_code": 0.0, "wall_s": 0.25})],
        metrics={"turns": 2.0, "tool_errors/bad_json": 1.0}, policy_version=7, ground_truth=None,
        earlier_segments=[TrajectorySegment([4, 5], [9, 9, 3], [1, 0, 1], [-0.5, 0.0, -1e-9],
                                  [Turn("assistant", 0, 1, None), Turn("tool", 1, 2), Turn("assistant", 2, 3, 0.75)],
                                            [3, -1, 4]),
                          TrajectorySegment([6], [], [], [], [])],
        token_versions=[5, 6, -1, -1],
    )
    return dataclasses.replace(t, **changes)


def test_trajectories_and_their_rows_round_trip_exactly(rollout, sample_rows, tmp_path):
    trajectories = rollout(SCRIPT, sample_rows, n=2)
    assert {t.finish_reason for t in trajectories} == {"stop", "interaction_done"}
    store = RolloutStore(tmp_path)
    path = store.write_step(3, trajectories + [odd_trajectory()], split="val", writer_id=4, rows=sample_rows)
    assert path.name == "val-step000003-w004.parquet"
    stored = list(store.iter_stored())
    assert [s.trajectory for s in stored] == trajectories + [odd_trajectory()]
    assert [(s.split, s.step, s.writer_id) for s in stored] == [("val", 3, 4)] * 7
    rows = dict(sample_rows)
    assert [s.row for s in stored[:6]] == [rows[t.row_id] for t in trajectories]
    assert stored[6].row is None  # no row was given for it
    assert pq.ParquetFile(path).schema_arrow.metadata[b"agentrl_schema_version"] == SCHEMA_VERSION.encode()


def test_a_shard_of_an_unknown_schema_version_is_refused_naming_the_file(tmp_path):
    store = RolloutStore(tmp_path)
    path = store.write_step(0, [odd_trajectory()])
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({"agentrl_schema_version": "99"}), path)
    with pytest.raises(DataError, match=rf"file {path}.*field agentrl_schema_version: schema version 99"):
        list(store.iter_trajectories())


def test_version_1_files_of_the_rollout_command_are_read_without_rows(tmp_path):
    t = odd_trajectory(earlier_segments=[], token_versions=[])  # version 1 kept no earlier segments nor token versions
    for call in t.tool_calls:
        call.metrics = {}  # version 1 kept no per-call metrics; they read back empty
    write_trajectories([t], tmp_path / "rollout-00000.parquet", step=5, split="train")
    [stored] = RolloutStore(tmp_path).iter_stored()
    assert stored.trajectory == t and (stored.split, stored.step, stored.writer_id, stored.row) == ("train", 5, 0, None)


def test_version_4_files_read_with_no_token_versions(tmp_path):
    path = RolloutStore(tmp_path).write_step(2, [odd_trajectory()])
    t4 = odd_trajectory(token_versions=[])
    for g in t4.earlier_segments:
        g.token_versions = []
    older = trajectories_to_table([t4], step=2)
    segment_type = pa.list_(pa.struct([f for f in older.schema.field("earlier_segments").type.value_type
                                       if f.name != "token_versions"]))
    older = older.drop_columns(["token_versions"]).set_column(
        older.schema.get_field_index("earlier_segments") - 1, "earlier_segments",
        pa.array([[{k: v for k, v in g.items() if k != "token_versions"} for g in row]
                  for row in older.column("earlier_segments").to_pylist()], type=segment_type))
    pq.write_table(older.replace_schema_metadata({"agentrl_schema_version": "4"}), path)
    [stored] = RolloutStore(tmp_path).iter_stored()
    assert stored.trajectory == t4 and stored.trajectory.oldest_version is None


def test_version_3_files_read_with_no_earlier_segments(tmp_path):
    path = RolloutStore(tmp_path).write_step(2, [odd_trajectory()])
    table = pq.read_table(path)
    older = table.drop_columns(["earlier_segments"]).replace_schema_metadata({"agentrl_schema_version": "3"})
    pq.write_table(older, path)
    [stored] = RolloutStore(tmp_path).iter_stored()
    assert stored.trajectory == odd_trajectory(earlier_segments=[])
    assert stored.trajectory.token_versions == [5, 6, -1, -1] and stored.trajectory.oldest_version == 5


def _store_with_variety(tmp_path) -> RolloutStore:
    store = RolloutStore(tmp_path)
    for step in range(4):
        store.write_step(step, [
            odd_trajectory(row_id=f"a{step}", data_source="math", reward=step / 4, finish_reason="stop"),
            odd_trajectory(row_id=f"b{step}", data_source="code", reward=1.0, finish_reason="length"),
        ])
    store.write_step(2, [odd_trajectory(row_id="v2", data_source="math", reward=0.0, finish_reason="stop")], split="val")
    return store


def ids(store: RolloutStore, **filters) -> list[str]:
    return [t.row_id for t in store.iter_trajectories(**filters)]


def test_filters_select_by_step_range_source_reward_finish_reason_and_split(tmp_path):
    store = _store_with_variety(tmp_path)
    assert ids(store, steps=(1, 3), split="train") == ["a1", "b1", "a2", "b2"]
    assert ids(store, steps=(None, 1)) == ["a0", "b0"]
    assert ids(store, steps=(3, None)) == ["a3", "b3"]
    assert ids(store, data_source="code", steps=(0, 2)) == ["b0", "b1"]
    assert ids(store, data_source=["math"], split="val") == ["v2"]
    assert ids(store, min_reward=0.5, data_source="math") == ["a2", "a3"]
    assert ids(store, max_reward=0.25) == ["a0", "a1", "v2"]
    assert ids(store, finish_reason="length", min_reward=1.0, steps=(3, 4)) == ["b3"]
    assert ids(store, finish_reason=["stop"], split="train", max_reward=0.0) == ["a0"]
    assert store.steps() == [0, 1, 2, 3] and store.steps("val") == [2]
    assert [t.row_id for t in store.iter_trajectories(limit=3)] == ["a0", "b0", "a1"]


def test_finish_reasons_are_stored_as_their_values_and_read_back_as_members(tmp_path):
    store = RolloutStore(tmp_path)
    path = store.write_step(0, [odd_trajectory()])
    assert pq.read_table(path, columns=["finish_reason"]).column(0).to_pylist() == ["max_assistant_turns"]
    [t] = store.iter_trajectories(finish_reason="max_assistant_turns")
    assert t.finish_reason is TrajectoryFinish.MAX_ASSISTANT_TURNS


def test_the_store_refuses_an_unknown_finish_reason_in_a_filter_or_a_shard(tmp_path):
    store = RolloutStore(tmp_path)
    with pytest.raises(TrajectoryError, match=r"TrajectoryFilter.finish_reason: unknown finish reason 'timeout' \(known: stop, "):
        list(store.iter_trajectories(finish_reason=["stop", "timeout"]))  # a misspelling would select nothing
    table = trajectories_to_table([odd_trajectory()])
    column = table.schema.get_field_index("finish_reason")
    pq.write_table(table.set_column(column, "finish_reason", pa.array(["timeout"])), tmp_path / shard_name("train", 0, 0))
    with pytest.raises(TrajectoryError, match="trajectory row é/1: finish_reason: unknown finish reason 'timeout'"):
        list(store.iter_trajectories())


def test_shards_outside_the_step_range_are_never_opened(tmp_path):
    store = _store_with_variety(tmp_path)
    (tmp_path / "train-step000000-w000.parquet").write_bytes(b"not parquet at all")
    assert ids(store, steps=(1, 2)) == ["a1", "b1"]
    with pytest.raises(Exception):
        ids(store, steps=(0, 1))


def test_read_table_returns_only_the_columns_asked_for(tmp_path):
    store = _store_with_variety(tmp_path)
    table = store.read_table(["row_id", "reward"], TrajectoryFilter(steps=(2, 3), split="train"))
    assert table.column_names == ["row_id", "reward"]
    assert table.to_pylist() == [{"row_id": "a2", "reward": 0.5}, {"row_id": "b2", "reward": 1.0}]


CHILD = textwrap.dedent("""
    import sys
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.trajectory import Trajectory, Turn
    n = 2000
    t = Trajectory(row_id="r", group_id="g", sample_index=0, data_source="d", agent_name="tool_agent", prompt_ids=[1] * 50,
                   response_ids=[5] * n, response_mask=[1] * n, logprobs=[-0.5] * n, turns=[Turn("assistant", 0, n)],
                   messages=[], finish_reason="stop")
    store = RolloutStore(sys.argv[1], row_group_size=8)
    store.write_step(0, [t] * 4)
    store.write_step(1, [t] * 4)
    print("earlier shards written", flush=True)
    store.write_step(2, [t] * 50000)  # minutes of work: killed long before it ends
    print("big shard written", flush=True)
""")


def test_a_writer_killed_mid_shard_leaves_earlier_shards_readable_and_no_partial_shard(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "earlier shards written"
        deadline = time.monotonic() + 60
        while not [p for p in tmp_path.glob(".train-step000002-w000.parquet.tmp-*") if p.stat().st_size > 100_000]:
            assert time.monotonic() < deadline and child.poll() is None, "the big shard never started streaming"
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    store = RolloutStore(tmp_path)
    assert [p.name for p in store.shards()] == ["train-step000000-w000.parquet", "train-step000001-w000.parquet"]
    assert store.steps() == [0, 1]
    assert sum(1 for _ in store.iter_trajectories()) == 8
    [partial] = tmp_path.glob(".*.tmp-*")  # the interrupted write stays hidden ...
    t = next(store.iter_trajectories())
    store.write_step(2, [t])  # ... until the step is written again (a resumed run)
    assert not list(tmp_path.glob(".*.tmp-*")) and store.steps() == [0, 1, 2]


def test_a_write_that_fails_leaves_no_shard_and_no_temporary(tmp_path):
    store = RolloutStore(tmp_path)

    class Unserializable:
        pass

    bad = odd_trajectory(messages=[{"role": "user", "content": Unserializable()}])
    with pytest.raises(TypeError):
        store.write_step(0, [odd_trajectory(), bad])
    assert os.listdir(tmp_path) == []
