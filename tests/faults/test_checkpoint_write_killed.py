"""A process SIGKILLed while it writes a checkpoint: the previous checkpoint stays whole and is
the one a resume finds; the torn one is never read and the next save of its step replaces it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist

from agentrl.rundir import TRAINER_STATE, RunDir
from agentrl.trainer.checkpoint_io import read_state

WRITER = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path

    import safetensors.torch
    import torch

    from agentrl.config.schema import ActorConfig, OptimConfig
    from agentrl.rundir import TRAINER_STATE, RunDir
    from agentrl.trainer.dist import free_port
    from agentrl.trainer.workers import ActorWorker

    model_dir, run_dir = sys.argv[1], Path(sys.argv[2])
    actor = ActorWorker(model_path=model_dir, config=ActorConfig(optim=OptimConfig(lr=0.1)), total_steps=4, rank=0,
                        world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=0)
    run = RunDir(run_dir)
    with run.new_checkpoint(1, keep=2) as directory:
        actor.save(str(directory))
        (directory / TRAINER_STATE).write_text(json.dumps({"step": 1}))
    with torch.no_grad():  # step 2's weights differ from step 1's everywhere
        for p in actor.model.parameters():
            p.add_(1.0)
    real_save = safetensors.torch.save_file

    def save_half_then_die(tensors, filename, *args, **kwargs):
        real_save(tensors, filename, *args, **kwargs)
        size = os.path.getsize(filename)
        with open(filename, "r+b") as f:
            f.truncate(size // 2)  # the kill lands mid-file
        os.kill(os.getpid(), signal.SIGKILL)

    safetensors.torch.save_file = save_half_then_die
    with run.new_checkpoint(2, keep=2) as directory:
        actor.save(str(directory))
        (directory / TRAINER_STATE).write_text(json.dumps({"step": 2}))
    print("not killed")
""")


def test_a_checkpoint_write_killed_leaves_the_previous_one_whole_and_resumable(tmp_path, tiny_model_dir):
    done = subprocess.run([sys.executable, "-c", WRITER, str(tiny_model_dir), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    run = RunDir(tmp_path)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_1", "step_2.tmp"]
    assert not (run.checkpoints / "step_2.tmp" / TRAINER_STATE).exists()  # torn: the kill came before it was complete
    assert run.latest_checkpoint() == run.checkpoints / "step_1"

    from agentrl.config.schema import ActorConfig
    from agentrl.trainer.dist import free_port
    from agentrl.trainer.workers import ActorWorker

    saved = read_state(run.checkpoints / "step_1", "actor")["model"]
    actor = ActorWorker(model_path=str(tiny_model_dir), config=ActorConfig(), total_steps=4, rank=0, world_size=1,
                        master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=1)
    try:
        with torch.no_grad():
            for p in actor.model.parameters():
                p.zero_()
        actor.load(str(run.checkpoints / "step_1"))  # the resume's load: every check passes
        state = actor.model.state_dict()
        assert all(torch.equal(state[name], tensor) for name, tensor in saved.items())
        with run.new_checkpoint(2, keep=2) as directory:  # the step is saved again, over the torn copy
            actor.save(str(directory))
            (directory / TRAINER_STATE).write_text(json.dumps({"step": 2}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_1", "step_2"]
    assert run.latest_checkpoint() == run.checkpoints / "step_2"
