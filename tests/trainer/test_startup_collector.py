"""``agentrl train`` starts with Python's garbage collector paused (``agentrl.trainer.startup``):
``pause_collector`` turns it off, ``resume_collector`` frees what the pause left and turns it on
again, once; the ``train`` command pauses it before its imports, the trainer resumes it once its
models are loaded (before the first step), and the command leaves it on whatever way it ends."""

from __future__ import annotations

import gc
import weakref

import pytest

from agentrl import cli
from agentrl.trainer import startup


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def collector_on():
    """Each test starts with the collector on and no pause, and leaves it so."""
    startup._paused = False
    gc.enable()
    yield
    startup._paused = False
    gc.enable()


def test_resume_frees_the_cycles_of_the_pause_and_turns_the_collector_on_once():
    assert startup.pause_collector() is True
    assert not gc.isenabled()
    cycle = Node()
    freed = weakref.ref(cycle)
    del cycle
    gc.collect(0)  # a young collection alone does not end the pause
    assert not gc.isenabled()
    assert startup.resume_collector() is True
    assert freed() is None
    assert gc.isenabled()
    assert startup.resume_collector() is False  # nothing paused: nothing to do
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off():
    gc.disable()
    assert startup.pause_collector() is False
    assert startup.resume_collector() is False
    assert not gc.isenabled()


@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_the_train_command_runs_paused_and_ends_with_the_collector_on(monkeypatch, outcome):
    seen = []

    def command(argv):
        seen.append((argv, gc.isenabled()))
        if outcome == "raises":  # before the trainer resumed it: main resumes it
            raise cli.AgentrlError("data.train_files: no such file")
        return 0

    monkeypatch.setattr(cli, "_resolve", lambda target: command)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # shared_machine_wait_policy leaves the environment alone
    assert cli.main(["train", "trainer.total_steps=1"]) == (0 if outcome == "returns" else 1)
    assert seen == [(["trainer.total_steps=1"], False)]
    assert gc.isenabled() and startup._paused is False


def test_other_commands_keep_the_collector_on(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "_resolve", lambda target: lambda argv: seen.append(gc.isenabled()) or 0)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cli.main(["sft", "sft.epochs=1"]) == 0
    assert seen == [True]


def test_the_trainer_resumes_the_collector_before_its_first_step(tmp_path, monkeypatch):
    from agentrl.config import load_config
    from agentrl.trainer import run

    on_at_step = []
    train_step = run.Trainer.train_step

    def recording(self, step, rows):
        on_at_step.append(gc.isenabled())
        return train_step(self, step, rows)

    monkeypatch.setattr(run.Trainer, "train_step", recording)
    cfg = load_config("train", [
        "trainer.total_steps=1", "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false",
        "trainer.export_hf=false", "trainer.save_rollouts=false", "data.train_batch_size=2", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4", "data.task_train_size=4",
        "data.task_val_size=2", "rollout.max_new_tokens=4", "data.max_response_length=8", "sft.enable=false",
        "logging.progress=false", f"trainer.runs_root={tmp_path}", "trainer.run_name=run",
    ])
    startup.pause_collector()
    run.train(cfg)
    assert on_at_step == [True]
    assert startup._paused is False
