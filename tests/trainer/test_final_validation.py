"""``trainer.final_validation``: the validation after the last step is its own switch; unset, it
follows ``test_freq`` (``test_freq=0``: no validation after training, as none during it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agentrl.config import validate_config
from agentrl.trainer import run


class FakeTrainer:
    """What ``_train_once`` asks of a Trainer, recording the steps it validated at."""

    validated: list[int] = []
    policies = None  # no trained roles

    def __init__(self, cfg, run_dir, *, log, startup):
        self.start_step, self.driver, self.startup = 0, None, startup
        self.dataset = SimpleNamespace(next_batch=lambda: [])
        self.actor = SimpleNamespace(call_rank0=lambda name: {"actor/trainable_parameters": 1, "actor/parameters": 1},
                                     call_all=lambda *a: None)
        self.health = SimpleNamespace(check=lambda step, metrics: None)

    def during(self, what):
        pass

    def validate(self, step):
        FakeTrainer.validated.append(step)
        return {"val/success_rate": 0.5}

    def train_step(self, step, rows):
        return {"reward/mean": 0.0, "success_rate": 0.0}

    def save(self, step):
        pass

    def close(self):
        pass


@pytest.mark.parametrize(("test_freq", "final", "validated", "after"), [
    (0, None, [], None),  # test_freq=0: no validation at all (val_before_train off here)
    (0, True, [3], 0.5),
    (2, None, [2, 3], 0.5),  # the default follows test_freq, as before the switch
    (2, False, [2], None),
])
def test_the_final_validation_follows_test_freq_unless_set(monkeypatch, test_freq, final, validated, after):
    monkeypatch.setattr(run, "Trainer", FakeTrainer)
    FakeTrainer.validated = []
    overrides = {"trainer": {"total_steps": 3, "test_freq": test_freq, "final_validation": final, "save_freq": 0,
                             "val_before_train": False, "export_hf": False}, "logging": {"progress": False}}
    cfg = validate_config(overrides, check_files=False)
    summary: dict = {}
    log = SimpleNamespace(log=lambda step, metrics: None, console=lambda line: None)
    run._train_once(cfg, SimpleNamespace(path=None), log, summary, restarted=True)
    assert FakeTrainer.validated == validated
    assert summary.get("heldout_success_after") == after
