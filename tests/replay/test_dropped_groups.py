"""Groups an asynchronous run finished and dropped as stale are stored beside the step's trained
groups, marked (schema version 6, column ``dropped``): the driver marks them, older stores read
as all trained, ``replay show`` marks them, ``replay report``'s per-step figures and ``replay
train`` leave them out (``--include-dropped`` trains them too), ``rescore`` keeps the mark."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

from agentrl.agent.async_rollout import FinishedGroup
from agentrl.data.rollout_store import RolloutStore
from agentrl.replay.cli import cli_main, metrics_by_step
from agentrl.replay.train import batches_to_train, stored_batch
from agentrl.trajectory import Trajectory


def member(group_id: str, i: int, reward: float) -> Trajectory:
    return Trajectory(row_id=group_id.split(":")[-1], group_id=group_id, sample_index=i, data_source="d",
                      agent_name="single_turn", prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1],
                      logprobs=[-0.5, -0.5], turns=[], messages=[], finish_reason="stop", reward=reward)


def driven_store(tmp_path) -> RolloutStore:
    """The shard of step 3 of an asynchronous run (trainer/async_driver.py) that trained two
    groups (rewards 1 and 0) and dropped one as stale (reward 1)."""
    from agentrl.config import load_config
    from agentrl.data.dataset import rows_from_dicts
    from agentrl.trainer.async_driver import AsyncDriver

    cfg = load_config("train", ["rollout.max_staleness=1", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                                "actor.rollout_correction.level=token"], check_files=False)
    store = RolloutStore(tmp_path / "rollouts")
    trained = [FinishedGroup(f"train2/{i}:r{i}", 2, [member(f"train2/{i}:r{i}", j, float(i == 0)) for j in range(2)])
               for i in range(2)]
    stale = [FinishedGroup("train0/0:old", 0, [member("train0/0:old", j, 1.0) for j in range(2)])]
    online = []
    trainer = SimpleNamespace(
        cfg=cfg, store=store, weight_version=2, log=SimpleNamespace(console=print),
        actor=SimpleNamespace(call_rank0=lambda method, *a, **k: {}),
        step=SimpleNamespace(online=lambda ts, step: online.append(ts) or SimpleNamespace(
            updated_actor=False, metrics={"reward/mean": sum(t.reward for t in ts) / len(ts)},
            batch=SimpleNamespace(attention_mask=torch.ones(4, 3)))),
        health_metrics=lambda *a, **k: {})
    driver = AsyncDriver(trainer)
    rows = rows_from_dicts([{"data_source": "d", "prompt": [{"role": "user", "content": "q"}], "extra_info": {"index": i}}
                            for i in range(3)])
    driver.rows = {g.group_id: rows[i] for i, g in enumerate(trained + stale)}
    driver.take = lambda step: (trained, stale, 0.0)
    metrics = driver.train_step(2)
    assert [t.group_id for t in online[0]] == ["train2/0:r0"] * 2 + ["train2/1:r1"] * 2  # the stale group is not trained
    assert metrics["async/dropped_groups"] == 1.0 and metrics["reward/mean"] == 0.5
    return store


def test_the_driver_stores_its_stale_groups_marked_and_readers_tell_them_from_the_trained(tmp_path):
    store = driven_store(tmp_path)
    every = list(store.iter_stored())
    assert [(s.step, s.trajectory.group_id, s.dropped) for s in every] == [
        (3, "train2/0:r0", None), (3, "train2/0:r0", None), (3, "train2/1:r1", None), (3, "train2/1:r1", None),
        (3, "train0/0:old", "stale"), (3, "train0/0:old", "stale")]
    assert [t.group_id for t in store.iter_trajectories(dropped=True)] == ["train0/0:old"] * 2
    assert [t.reward for t in store.iter_trajectories(dropped=False)] == [1.0, 1.0, 0.0, 0.0]
    # replay report: the step's reward is the trained groups' (the run's reward/mean), not 3 groups' (4/6)
    [row] = metrics_by_step(store)
    assert row["step"] == 3 and row["reward/mean"] == 0.5
    # replay train: the trained groups only, unless asked
    assert batches_to_train(store, split="train", steps=None) == ([3], 2)
    assert [t.group_id for t in stored_batch(store, "train", 3)] == ["train2/0:r0"] * 2 + ["train2/1:r1"] * 2
    assert batches_to_train(store, split="train", steps=None, include_dropped=True) == ([3], 0)
    assert len(stored_batch(store, "train", 3, include_dropped=True)) == 6


def test_show_marks_the_dropped_groups_and_counts_them(tmp_path, capsys):
    store = driven_store(tmp_path)
    capsys.readouterr()
    assert cli_main(["show", str(store.root)]) == 0
    out = capsys.readouterr().out.splitlines()
    headers = [line for line in out if line.startswith("═ ")]
    assert headers[0] == "═ train step 3 · r0 #0 · reward 1 · finish stop"
    assert headers[4] == "═ train step 3 · old #0 · reward 1 · finish stop · DROPPED (stale): not trained"
    assert out[-1] == "6 trajectories shown, of which 2 of groups dropped untrained (stale 2)"


def test_stores_before_version_6_read_as_trained_and_rescore_keeps_the_mark(tmp_path):
    from agentrl.replay.rescore import rescore_store

    store = driven_store(tmp_path)
    [path] = store.shards()
    table = pq.read_table(path)
    older = RolloutStore(tmp_path / "v5")
    older.root.mkdir()
    pq.write_table(table.drop_columns(["dropped"]).replace_schema_metadata({"agentrl_schema_version": "5"}),
                   older.root / path.name)
    assert [s.dropped for s in older.iter_stored()] == [None] * 6  # no mark: all read as trained
    assert len(list(older.iter_trajectories(dropped=False))) == 6 and batches_to_train(older, split="train", steps=None)[1] == 0
    rescored = RolloutStore(tmp_path / "rescored")
    rescore_store(store, rescored, "gsm8k")
    assert [s.dropped for s in rescored.iter_stored()] == [None] * 4 + ["stale"] * 2
    with pytest.raises(ValueError, match=r"dropped: unknown reason\(s\) \['late'\] \(known: stale, filtered\)"):
        store.write_step(4, [member("g", 0, 0.0)], dropped={"g": "late"})
