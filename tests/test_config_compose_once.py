"""``compose`` loads and merges the YAML files once: the value overrides go onto the config the
group overrides composed, through Hydra's own parser and override code, and give what composing
every file again with them gave (the result, or the error's words). A ``hydra.`` key or a
config group's name is left to Hydra's composition, which treats those otherwise."""

from __future__ import annotations

import hydra
import pytest

from agentrl.config import loader
from agentrl.errors import ConfigError

CASES = [
    ["algorithm=ppo", "trainer.seed=3", "data.train_files=[a.parquet,b.parquet]", "data.train_files.0=c.parquet"],
    ["~trainer.total_steps", "+trainer.extra={a: 1}", "actor.optim={lr: 0.1}"],
    ["rollout={a: 1}"],  # a key the YAML has, merged under Hydra's struct flag: refused
    ["trainer.total_steps=1,2"],  # a sweep
    ["~nosuch.key"],
]


def _outcome(overrides: list[str]) -> tuple[str, object]:
    try:
        return "ok", loader.compose("train", overrides)
    except ConfigError as exc:
        return "error", str(exc)


@pytest.fixture
def composes(monkeypatch) -> list[list[str]]:
    calls: list[list[str]] = []
    compose = hydra.compose

    def counted(*args, **kwargs):
        calls.append(list(kwargs["overrides"]))
        return compose(*args, **kwargs)

    monkeypatch.setattr(hydra, "compose", counted)
    return calls


def test_value_overrides_give_what_a_second_composition_gave(monkeypatch, composes):
    once = [_outcome(case) for case in CASES]
    assert composes == [["algorithm=ppo"], [], [], [], []]  # each once, with its group overrides alone
    monkeypatch.setattr(loader, "_with_value_overrides", lambda base, overrides, groups: None)  # every file composed again
    assert [_outcome(case) for case in CASES] == once
    assert once[0][1]["trainer"]["seed"] == 3 and once[0][1]["data"]["train_files"] == ["c.parquet", "b.parquet"]
    assert once[0][1]["algorithm"]["adv_estimator"] == "gae"
    assert once[2] == ("error", "invalid configuration (1 problem):\n  <overrides>: Could not override 'rollout'.")
    assert once[3][1].startswith("invalid configuration (1 problem):\n  <overrides>: Ambiguous value for argument 'trainer.total_steps=1,2'")
    assert once[4] == ("error", "invalid configuration (1 problem):\n  <overrides>: Could not delete from config. 'nosuch.key' does not exist.")


@pytest.mark.parametrize("override", ["hydra.run.dir=elsewhere", "_data_defaults=solver_verifier"])
def test_what_only_hydras_composition_treats_is_composed_again(composes, override):
    _outcome([override])
    assert composes == [[], [f"++{override}"]]
