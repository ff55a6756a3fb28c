"""A weight sync broken on purpose stops the run at the step that would train on its samples
(``trainer.health``, trainer/health.py), with a checkpoint and the stop in ``summary.json`` and the
report: a sync skipped (the engine reports the old version), a stale copy on disk (the engine's
logprobs of the tokens it sampled differ from the trainer's under the same version), the LoRA
merge dropped, and a stale copy in an asynchronous run (read by the probe after each sync, since
its batches hold older versions' tokens). Tiny model, 2-4 steps, in this process."""

from __future__ import annotations

import json

import pytest
import torch

from agentrl.config import load_config
from agentrl.trainer import workers
from agentrl.trainer.run import train

FAST = [
    "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.export_hf=false",
    "trainer.save_rollouts=false", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=8", "data.task_train_size=32", "data.task_val_size=4", "rollout.max_new_tokens=32",
    "data.max_response_length=96", "sft.enable=false", "logging.progress=false", "actor.optim.lr=1e-3",
    # rewards that differ within a group (any number 0.5, the right one 1), so that every step moves the policy
    "reward.default=gsm8k_flexible", "reward.format_score=0.5", "model.tiny.skills=none", "rollout.temperature=0.7",
]


def _train(tmp_path, *extra: str):
    cfg = load_config("train", [*FAST, f"trainer.runs_root={tmp_path}", "trainer.run_name=run", *extra])
    result = train(cfg)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, {r["step"]: r for r in rows if "reward/mean" in r}


def _assert_stopped(result, step: int) -> dict:
    stopped = result.summary["stopped"]
    assert stopped["step"] == step == result.summary["steps"]
    assert json.loads((result.run_dir / "summary.json").read_text())["stopped"] == stopped
    assert (result.run_dir / "checkpoints" / f"step_{step}").is_dir()  # trainer.resume=auto goes on from here
    assert f"Stopped after {step} steps by {stopped['key']}" in (result.run_dir / "report.html").read_text()
    return stopped


def test_a_skipped_sync_stops_the_run_when_the_engine_reports_the_old_version(tmp_path, monkeypatch):
    monkeypatch.setattr(workers.ActorWorker, "sync_weights", lambda self, version: None)
    result, steps = _train(tmp_path, "trainer.total_steps=3")
    stopped = _assert_stopped(result, 1)  # step 2 would be the first to train on version 0's samples
    assert stopped["measure"] == "engine_version"
    assert stopped["reason"].startswith("step 1: after the weight sync to version 1 the engine reports weight version 0:")
    assert sorted(steps) == [1]
    # the sync fixed, the same command with trainer.resume=auto goes on from the stop's checkpoint
    monkeypatch.undo()
    resumed, steps = _train(tmp_path, "trainer.total_steps=3", "trainer.resume=auto")
    assert "stopped" not in resumed.summary and sorted(steps) == [1, 2, 3]
    assert steps[2]["health/engine_version"] == steps[2]["health/synced_version"] == 2.0


def export_the_first_version_only(monkeypatch) -> None:
    """A disk sync that writes the first version and then nothing: every later sync reloads it."""
    export = workers.ActorWorker.export_hf
    exported: list[str] = []

    def first_export_only(self, directory):
        if not exported:
            exported.append(directory)
            export(self, directory)

    monkeypatch.setattr(workers.ActorWorker, "export_hf", first_export_only)


def test_a_stale_copy_on_disk_stops_the_run_at_the_first_step_that_trains_on_it(tmp_path, monkeypatch):
    export_the_first_version_only(monkeypatch)  # the engine reloads version 1's files at every later sync
    result, steps = _train(tmp_path, "trainer.total_steps=3", "engine.weight_sync=disk",
                           "trainer.health.logprob_mismatch.stop_steps=1")
    stopped = _assert_stopped(result, 3)  # step 3's tokens were sampled by version 1's weights labelled 2
    assert stopped["measure"] == "logprob_mismatch" and stopped["key"] == "trainer.health.logprob_mismatch.stop"
    assert stopped["reason"].startswith("step 3: logprob_mismatch of the tokens sampled at weight version 2 = ")
    assert "LoRA adapters not merged" in stopped["reason"] and "trainer.resume=auto" in stopped["reason"]
    assert "stop=0.01: the engine that sampled" in stopped["reason"]  # one step is not "1 consecutive steps"
    assert steps[2]["health/logprob_mismatch"] < 1e-6 < 1e-2 < steps[3]["health/logprob_mismatch"]
    assert steps[3]["health/mismatch_tokens"] == steps[3]["tokens/sampled"]  # synchronous: every token counts


def test_a_dropped_lora_merge_warns_then_stops_on_the_second_step(tmp_path, monkeypatch, capsys):
    merge = workers.merged_state

    def unmerged(state, config):  # the engine gets the base weights: B zeroed folds nothing in
        return merge({k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in state.items()}, config)

    monkeypatch.setattr(workers, "merged_state", unmerged)
    result, steps = _train(tmp_path, "trainer.total_steps=4", "actor.lora.rank=4", "actor.optim.lr=1e-2")
    # defaults: a warning at the first step over 1e-2, the stop at the second in a row
    stopped = _assert_stopped(result, 3)
    assert "on 2 consecutive steps" in stopped["reason"]
    assert "warning: step 2: logprob_mismatch of the tokens sampled at weight version 1 = " in capsys.readouterr().err
    assert steps[1]["health/logprob_mismatch"] < 1e-6 and steps[2]["health/logprob_mismatch"] > 1e-2


def test_an_asynchronous_run_with_a_stale_copy_stops_by_the_probe_after_the_sync(tmp_path, monkeypatch):
    policy_state = workers.ActorWorker.policy_state
    frozen: dict = {}

    def stale(self, **kwargs):  # every sync after the first sends the first one's weights again
        if not frozen:
            frozen.update({k: v.clone() for k, v in policy_state(self, **kwargs).items()})
        return frozen

    monkeypatch.setattr(workers.ActorWorker, "policy_state", stale)
    result, steps = _train(tmp_path, "trainer.total_steps=4", "rollout.max_staleness=1", "engine.process=false",
                           "actor.rollout_correction.level=token", "trainer.health.logprob_mismatch.stop_steps=1")
    stopped = _assert_stopped(result, 2)  # the sync to version 2 sent version 1: step 3 would train on it
    assert stopped["reason"].startswith("step 2: logprob_mismatch of the tokens sampled at weight version 2 = ")
    assert steps[1]["health/logprob_mismatch"] < 1e-6 and steps[1]["health/mismatch_tokens"] == 16


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_healthy_run_passes_every_check(tmp_path, staleness):
    extra = ["rollout.max_staleness=1", "engine.process=false", "actor.rollout_correction.level=token"] if staleness else []
    result, steps = _train(tmp_path, "trainer.total_steps=2", *extra)
    assert "stopped" not in result.summary and sorted(steps) == [1, 2]
    for row in steps.values():
        assert row["health/logprob_mismatch"] < 1e-6 and row["health/mismatch_tokens"] > 0
        assert row["health/engine_version"] == row["health/synced_version"] == row["step"]


def test_a_stale_copy_on_an_sglang_server_stops_the_run_at_the_first_step_that_trains_on_it(tmp_path, monkeypatch):
    # the managed server is `agentrl serve` (SGLang's protocol, in seconds on this CPU); the sync goes by disk
    export_the_first_version_only(monkeypatch)  # the server reloads version 1's files at every later sync
    result, steps = _train(tmp_path, "trainer.total_steps=3", "engine=sglang", "engine.launcher=agentrl",
                           "trainer.health.logprob_mismatch.stop_steps=1")
    stopped = _assert_stopped(result, 3)
    assert stopped["reason"].startswith("step 3: logprob_mismatch of the tokens sampled at weight version 2 = ")
    # the versions the server itself reported (/get_model_info) after each sync
    assert [steps[s]["health/engine_version"] for s in (1, 2, 3)] == [1.0, 2.0, 3.0]
    assert steps[2]["health/logprob_mismatch"] < 1e-5
