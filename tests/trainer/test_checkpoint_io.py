"""Checkpoints are data: the actor's state round-trips through safetensors + JSON, and a crafted
checkpoint (pickle payload, wrong shapes or dtypes, truncated, symlinked out) is refused with a
CheckpointError before anything is loaded or run (real tiny model, 1-rank worker in this process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from agentrl.config.schema import ActorConfig, OptimConfig
from agentrl.errors import CheckpointError
from agentrl.trainer.batch import collate_sequences
from agentrl.trainer.checkpoint_io import FORMAT, convert_legacy, read_state, write_state
from agentrl.trainer.dist import free_port
from agentrl.trainer.workers import ActorWorker


class RunsACommand:
    """Unpickling this calls os.system: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    worker = ActorWorker(model_path=str(tiny_model_dir), config=ActorConfig(optim=OptimConfig(lr=1e-2)), total_steps=4,
                         rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=0)
    batch = collate_sequences([[5, 17, 99, 3]] * 2, [[7, 8, 9], [10, 11, 12]], [[1] * 3] * 2, pad_token_id=0)
    worker.sft_step(batch, float(batch.response_mask.sum()), 2)  # optimizer state and schedule that are not fresh
    yield worker
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(actor, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "step_1"
    actor.save(str(directory))
    return directory


def copy_of(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "step_1"))


def rewrite_tensors(directory: Path, change) -> None:
    path = directory / "actor" / "tensors.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": FORMAT})


def refused(actor: ActorWorker, directory: Path) -> str:
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        actor.load(str(directory))
    assert all(torch.equal(v, before[k]) for k, v in actor.model.state_dict().items())  # nothing was loaded
    return str(info.value)


def test_the_actor_state_round_trips_exactly_without_pickle(actor, saved):
    files = sorted(str(p.relative_to(saved)) for p in saved.rglob("*") if p.is_file())
    assert files == ["actor/state.json", "actor/tensors.safetensors"]
    model = {k: v.clone() for k, v in actor.model.state_dict().items()}
    optim = {name: {k: v.clone() for k, v in entry.items()} for name, entry in actor.optimizer.state_dict()["state"].items()}
    schedule, rng = actor.scheduler.state_dict(), torch.get_rng_state()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in actor.optimizer.param_groups]
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(1.0)
    for entry in actor.optimizer.state.values():
        entry["exp_avg"].zero_()
    actor.scheduler.step()
    torch.manual_seed(123)
    actor.load(str(saved))
    assert all(torch.equal(v, model[k]) for k, v in actor.model.state_dict().items())
    for name, entry in actor.optimizer.state_dict()["state"].items():
        assert {k: torch.equal(v, optim[name][k]) for k, v in entry.items()} == {k: True for k in optim[name]}
    after = [{k: v for k, v in g.items() if k != "params"} for g in actor.optimizer.param_groups]
    assert [{**g, "betas": tuple(g["betas"])} for g in after] == groups  # (torch's broadcast load makes betas a list)
    assert read_state(saved, "actor")["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)  # the file keeps the tuple
    assert actor.scheduler.state_dict() == schedule and actor.scheduler.last_epoch == 1
    assert torch.equal(torch.get_rng_state(), rng)
    state = json.loads((saved / "actor" / "state.json").read_text())
    assert state["format"] == FORMAT and isinstance(state["state"]["rng"], list)
    # the tied head is stored once and referenced under both names
    model_refs = state["state"]["model"]
    assert model_refs["lm_head.weight"] == model_refs["model.embed_tokens.weight"] == {"__tensor__": "model/model.embed_tokens.weight"}


def test_a_pickle_checkpoint_is_refused_with_the_conversion_command_and_runs_nothing(actor, tmp_path):
    marker = tmp_path / "pwned"
    directory = tmp_path / "step_1"
    directory.mkdir()
    torch.save({"model": {}, "payload": RunsACommand(marker)}, directory / "actor.pt")
    message = refused(actor, directory)
    assert "pickle checkpoint of an older agentrl" in message and f"agentrl checkpoint convert {directory}" in message
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refused by torch.load\\(weights_only=True\\)"):
        convert_legacy(directory)  # the converter's restricted unpickler refuses it too
    assert not marker.exists()


def test_a_pickle_payload_in_place_of_the_tensor_file_is_refused_and_runs_nothing(actor, saved, tmp_path):
    marker = tmp_path / "pwned"
    directory = copy_of(saved, tmp_path)
    torch.save({"payload": RunsACommand(marker)}, directory / "actor" / "tensors.safetensors")
    assert "not a valid safetensors file" in refused(actor, directory)
    assert not marker.exists()


def test_a_tensor_of_the_wrong_shape_is_refused_naming_it(actor, saved, tmp_path):
    directory = copy_of(saved, tmp_path)
    rewrite_tensors(directory, lambda t: t.update({"model/model.norm.weight": torch.ones(3)}))
    assert "model.norm.weight has shape [3], the model's is [128]" in refused(actor, directory)


def test_a_tensor_of_the_wrong_dtype_is_refused_naming_it(actor, saved, tmp_path):
    directory = copy_of(saved, tmp_path)
    rewrite_tensors(directory, lambda t: t.update({"model/model.norm.weight": t["model/model.norm.weight"].double()}))
    assert "model.norm.weight has dtype torch.float64, the model's is torch.float32" in refused(actor, directory)


def test_an_optimizer_moment_of_another_shape_is_refused(actor, saved, tmp_path):
    directory = copy_of(saved, tmp_path)
    rewrite_tensors(directory, lambda t: t.update({"optimizer/state/model.norm.weight/exp_avg": torch.zeros(7)}))
    assert "optimizer state model.norm.weight/exp_avg has shape [7]" in refused(actor, directory)


def test_a_truncated_tensor_file_is_refused(actor, saved, tmp_path):
    directory = copy_of(saved, tmp_path)
    path = directory / "actor" / "tensors.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert "damaged or truncated" in refused(actor, directory)


def test_a_symlink_out_of_the_run_directory_is_refused(actor, saved, tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.copytree(saved, outside / "step_1")
    run = tmp_path / "run"
    directory = Path(shutil.copytree(saved, run / "checkpoints" / "step_1"))
    link = directory / "actor" / "tensors.safetensors"
    link.unlink()
    link.symlink_to(outside / "step_1" / "actor" / "tensors.safetensors")  # one file
    assert f"outside {run.resolve()}, where a checkpoint's files must stay" in refused(actor, directory)
    (run / "checkpoints" / "step_2").symlink_to(outside / "step_1", target_is_directory=True)  # a whole step
    assert f"outside {run.resolve()}, where a checkpoint's files must stay" in refused(actor, run / "checkpoints" / "step_2")
    link.unlink()
    link.symlink_to(directory / "actor" / "state.json")
    assert "not a valid safetensors file" in refused(actor, directory)  # inside the run: followed, then checked as any file


def test_a_state_file_referring_to_a_missing_tensor_is_refused(actor, saved, tmp_path):
    directory = copy_of(saved, tmp_path)
    path = directory / "actor" / "state.json"
    state = json.loads(path.read_text())
    state["state"]["model"]["lm_head.weight"] = {"__tensor__": "model/elsewhere"}
    path.write_text(json.dumps(state))
    assert "refers to tensor 'model/elsewhere', which the tensor file lacks" in refused(actor, directory)


def test_a_deeply_nested_state_file_is_refused(actor, saved, tmp_path):
    directory = copy_of(saved, tmp_path)
    (directory / "actor" / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "not valid JSON" in refused(actor, directory)


def test_state_that_is_not_data_cannot_be_written(tmp_path):
    # not builtins.print: Ray replaces it with a function of its own once a run has started in the process
    with pytest.raises(CheckpointError, match="Path at scheduler/fn is not data"):
        write_state(tmp_path, "actor", {"scheduler": {"fn": tmp_path}})


def test_an_older_pickle_checkpoint_converts_with_the_cli_and_then_loads(actor, saved, tmp_path):
    directory = tmp_path / "old" / "step_1"
    directory.mkdir(parents=True)
    new = read_state(saved, "actor")
    # the format agentrl wrote before: one torch.save pickle of the same state, the RNG as a tensor
    torch.save({**new, "rng": torch.tensor(new["rng"], dtype=torch.uint8)}, directory / "actor.pt")
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "checkpoint", "convert", str(directory)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"wrote {directory / 'actor'}" in done.stdout
    converted = read_state(directory, "actor")
    assert converted["rng"] == new["rng"] and converted["scheduler"] == new["scheduler"]
    assert all(torch.equal(converted["model"][k], v) for k, v in new["model"].items())
    actor.load(str(directory))


def test_the_critic_state_round_trips_and_is_checked_against_the_value_model(actor, tiny_model_dir, tmp_path):
    from agentrl.config.schema import CriticConfig
    from agentrl.trainer.workers import CriticWorker

    critic = CriticWorker(model_path=str(tiny_model_dir), config=CriticConfig(), total_steps=4,
                          rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device="cpu", seed=0)
    with torch.no_grad():
        critic.model.head.weight.fill_(0.25)
    critic.save(str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "critic").iterdir()) == ["state.json", "tensors.safetensors"]
    saved = {k: v.clone() for k, v in critic.model.state_dict().items()}
    with torch.no_grad():
        critic.model.head.weight.zero_()
        critic.model.backbone.norm.weight.add_(1.0)
    critic.load(str(tmp_path))
    assert all(torch.equal(v, saved[k]) for k, v in critic.model.state_dict().items())
    # the actor's state is not a critic's: names differ, and it is refused naming them
    actor.save(str(tmp_path / "other"))
    (tmp_path / "other" / "actor").rename(tmp_path / "other" / "critic")
    with pytest.raises(CheckpointError, match="model tensors do not match the model: missing \\['backbone"):
        critic.load(str(tmp_path / "other"))


@pytest.mark.ray
def test_agentrl_train_refuses_to_resume_from_a_pickle_payload_and_runs_nothing(tmp_path):
    """The issue's scenario end to end: `agentrl train trainer.resume=<run>` over a step whose actor.pt
    carries an os.system payload stops with the conversion message; the command never ran."""
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 1, "data": {}, "kl_coef": 0.0, "rng": []}))
    torch.save({"model": {}, "optimizer": {}, "scheduler": {}, "payload": RunsACommand(marker)}, step / "actor.pt")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", f"trainer.resume={run}", "trainer.total_steps=2", "data.train_batch_size=4",
         "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4", "data.task_train_size=8", "data.task_val_size=4", "logging.progress=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env,
    )
    assert done.returncode != 0
    assert "pickle checkpoint of an older agentrl" in done.stderr and f"agentrl checkpoint convert {step}" in done.stderr
    assert not marker.exists()
