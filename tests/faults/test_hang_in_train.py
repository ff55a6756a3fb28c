"""A hang inside `agentrl train` on two ranks ends the run with an error, the ranks' stacks and its
checkpoints intact.

Rank 1 of the actor group is made to sleep in its third `update_on_policy` call (step 3: one
mini-batch a step, so the update computes the old logprobs in its own forward), so that
rank 0 waits alone in FSDP2's all-gather: a `sitecustomize` on the job's `PYTHONPATH` (which
reaches the Ray workers, see `cluster.worker_env`) wraps the method wherever agentrl's workers
module is imported; only rank 1, a worker process, sleeps. With `trainer.collective_timeout_s=15` the run must end within the
timeout and its grace, naming the step, the group, the call and the rank, with rank 1's stack
file in the run directory showing the sleep, and the checkpoint of step 2 whole."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.ray

TIMEOUT_S = 15

SITECUSTOMIZE = textwrap.dedent('''
    import importlib.abc, importlib.util, sys, time

    class _StallRank1(importlib.abc.MetaPathFinder):
        """Once agentrl.trainer.workers is imported, rank 1's third update_on_policy sleeps."""

        def find_spec(self, name, path, target=None):
            if name != "agentrl.trainer.workers":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                original = module.ActorWorker.update_on_policy
                calls = {"n": 0}

                def update_on_policy(self, *args, **kwargs):
                    if self.rank == 1:
                        calls["n"] += 1
                        if calls["n"] == 3:
                            time.sleep(600)
                    return original(self, *args, **kwargs)

                module.ActorWorker.update_on_policy = update_on_policy

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _StallRank1())
''')


@pytest.mark.timeout(400)
def test_a_rank_stuck_in_train_ends_the_run_with_stacks_and_checkpoints_intact(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    args = [
        "sft.enable=false", "trainer.total_steps=6", "actor.world_size=2", "data.train_batch_size=2", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2", "trainer.save_freq=1",
        "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.threads_per_worker=1", "trainer.export_hf=false",
        "rollout.max_new_tokens=16", "data.max_response_length=64", "data.task_val_size=2", "logging.progress=false",
        f"trainer.collective_timeout_s={TIMEOUT_S}", f"trainer.runs_root={tmp_path}", "trainer.run_name=stuck",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(hook), *filter(None, [env.get("PYTHONPATH")])])
    job = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", *args], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = tmp_path / "stuck"
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / "step_2").is_dir():
        assert job.poll() is None, job.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no checkpoint of step 2 within 240 s"
        time.sleep(0.1)
    stuck_from = time.monotonic()
    out, _ = job.communicate(timeout=200)
    waited = time.monotonic() - stuck_from
    assert job.returncode != 0
    assert waited < 2 * TIMEOUT_S + 30, f"the hang took {waited:.0f} s to end the run"
    assert "step 3 of 6: actor group: `update_on_policy` hangs: rank(s) [1] of 2 did not answer" in out, out[-3000:]
    stacks = run / "actor-rank1-stacks.txt"
    assert str(stacks) in out
    dumped = stacks.read_text()  # faulthandler's dump: rank 1 is in the sleep, inside update_on_policy
    assert "sitecustomize.py" in dumped and "update_on_policy" in dumped
    # the last checkpoint is whole: the trainer state and the actor's tensors are there
    assert (run / "checkpoints" / "step_2" / "trainer_state.json").is_file()
    assert (run / "checkpoints" / "step_2" / "actor" / "tensors.safetensors").is_file()
    assert not (run / "checkpoints" / "step_3").exists()
