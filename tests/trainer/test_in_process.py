"""``trainer.workers``: a job whose groups have one rank each runs them in the driver's process
(no Ray, the model loaded once) and trains exactly as the Ray actors do.

The equality run is PPO with a critic and a reference (three groups, a checkpoint), through the
CLI in a process of its own: every metric that is not a time agrees with the Ray run's, the
checkpoint's tensors too (to fp32 rounding), and the in-process run never imported Ray."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.trainer.in_process import runs_in_process

COMMON = [
    "sft.enable=false", "algorithm=ppo", "trainer.total_steps=3", "trainer.save_freq=2", "trainer.test_freq=0",
    "trainer.val_before_train=false", "trainer.export_hf=false", "logging.progress=false", "data.task_val_size=4",
    "actor.use_kl_loss=true",
]
# the driver reports whether it imported Ray before it exits
LAUNCHER = "import sys; from agentrl.cli import main; rc = main(sys.argv[1:]); print('ray imported:', 'ray' in sys.modules); sys.exit(rc)"


def _train(tmp_path, name: str, *extra: str):
    done = subprocess.run([sys.executable, "-c", LAUNCHER, "train", *COMMON, *extra, f"trainer.runs_root={tmp_path}",
                           f"trainer.run_name={name}"], cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / name
    steps = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r}
    return run, steps, json.loads((run / "summary.json").read_text()), done.stdout


def _not_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("timing/", "startup/")) and k != "tokens/per_s"}


@pytest.mark.timeout(600)
def test_in_process_groups_train_as_the_ray_actors_do(tmp_path):
    from safetensors.torch import load_file

    local, local_steps, local_summary, local_out = _train(tmp_path, "local")  # trainer.workers=auto
    ray, ray_steps, ray_summary, ray_out = _train(tmp_path, "ray", "trainer.workers=ray")

    assert "ray imported: False" in local_out and "ray imported: True" in ray_out
    assert "startup/ray_s" not in local_summary and "startup/ray_s" in ray_summary
    # the three groups are built in the driver, and their load is timed as the Ray actors' start is
    assert "startup/actor_reference_critic_workers_s" in local_summary
    assert sorted(local_steps) == sorted(ray_steps) == [1, 2, 3]
    for step in local_steps:
        mine, theirs = _not_timing(local_steps[step]), _not_timing(ray_steps[step])
        assert mine.keys() == theirs.keys()
        for key in mine:
            # as the resumed and the disk-synced runs are compared (test_train_run.py): the two
            # processes' thread teams may differ (a worker starts with its OMP_NUM_THREADS, the
            # driver sets its count after start), fp32 sums round differently, and Adam carries
            # that into later steps (a CI run: pg_loss 2.6e-7 apart at step 3)
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (step, key)
    assert local_steps[3]["critic/grad_norm"] > 0 and local_steps[3]["actor/grad_norm"] > 0
    for role in ("actor", "critic"):
        a = load_file(local / "checkpoints" / "step_2" / role / "tensors.safetensors")
        b = load_file(ray / "checkpoints" / "step_2" / role / "tensors.safetensors")
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


@pytest.mark.timeout(400)
def test_sft_runs_in_process_and_fits_as_the_ray_actor_does(tmp_path):
    """``agentrl sft`` with one rank: no Ray, and the same fit as on a Ray actor."""
    out = {}
    for name, extra in (("local", []), ("ray", ["trainer.workers=ray"])):
        done = subprocess.run([sys.executable, "-c", LAUNCHER, "sft", "sft.num_demos=8", "sft.epochs=1", "sft.batch_size=4",
                               "sft.micro_batch_size=4", "trainer.save_freq=0", "logging.progress=false", *extra,
                               f"trainer.runs_root={tmp_path}", f"trainer.run_name={name}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = json.loads((tmp_path / name / "summary.json").read_text()), done.stdout
        assert (tmp_path / name / "policy" / "config.json").is_file()
    (local, local_stdout), (ray, ray_stdout) = out["local"], out["ray"]
    assert "ray imported: False" in local_stdout and "ray imported: True" in ray_stdout
    assert local["steps"] == ray["steps"] == 2
    assert local["final_loss"] == pytest.approx(ray["final_loss"], rel=1e-4, abs=1e-6)


def test_which_jobs_run_in_process(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert runs_in_process(load_config("train"))
    assert runs_in_process(load_config("train", ["algorithm=ppo"]))  # actor, reference, critic: one rank each
    assert not runs_in_process(load_config("train", ["actor.world_size=2", "actor.ppo_micro_batch_size_per_gpu=1"]))
    assert not runs_in_process(load_config("train", ["algorithm=ppo", "critic.world_size=2", "critic.ppo_micro_batch_size_per_gpu=1"]))
    assert not runs_in_process(load_config("train", ["trainer.max_restarts=1"]))  # restarts need processes to lose
    assert not runs_in_process(load_config("train", ["trainer.workers=ray"]))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # joining a cluster
    assert not runs_in_process(load_config("train"))
    assert runs_in_process(load_config("train", ["trainer.workers=local"]))


def test_local_workers_refuse_several_ranks():
    with pytest.raises(ConfigError) as caught:
        load_config("train", ["trainer.workers=local", "actor.world_size=2", "actor.ppo_micro_batch_size_per_gpu=1"])
    assert ("trainer.workers", "local runs one rank per group in the driver's process, but actor.world_size = 2") in caught.value.problems
