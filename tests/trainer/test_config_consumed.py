"""No silent no-op configuration (#47 item 3): every key of the schema is read by the configured
run, or ``agentrl.config.inert`` says why it is not (and ``agentrl train`` names it before any
work when it is set on the command line).

The walk: one short step, in this process, of each representative configuration (GRPO with the
built-in engine, PPO with a critic, asynchronous GRPO), with every read of a config field
recorded; each leaf key must be read, inert by a rule, or read on a path a one-step run does not
take (``READ_WHEN``, with the condition)."""

from __future__ import annotations

import pytest

from agentrl.config import health, load_config, schema
from agentrl.config.inert import inert_overrides, inert_reason
from agentrl.trainer.run import train

ENVIRONMENT = "an environment runs: environment.library, or a row's extra_info.environment"
HEALTH = "the measure reaches its warn bound (trainer/health.py reads warn_steps then)"
READ_WHEN: dict[str, str] = {
    "rollout.val_n": "a validation runs (trainer.val_before_train, trainer.test_freq)",
    "trainer.max_checkpoints": "a checkpoint is saved (trainer.save_freq, a health stop)",
    "trainer.ship_code": "the worker groups run under Ray (trainer.workers)",
    **{f"trainer.health.{m}.warn_steps": HEALTH for m in ("logprob_mismatch", "tool_errors", "malformed_calls", "failures")},
    **{f"trainer.health.stale_groups.{k}": "an asynchronous step drops a stale group" for k in ("warn", "warn_steps", "stop", "stop_steps")},
    **{f"environment.{k}": ENVIRONMENT for k in ("name", "args")},
    **{f"environment.openenv.{k}": ENVIRONMENT for k in ("url", "max_sessions", "start_timeout_s", "step_timeout_s", "action",
                                                          "observation_field", "reward")},
    "environment.verifiers.client": ENVIRONMENT,
    **{f"environment.trl.{k}": ENVIRONMENT for k in ("reward_funcs", "reward_weights")},
}

ONE_STEP = [
    "trainer.total_steps=1", "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false",
    "trainer.export_hf=false", "trainer.save_rollouts=false", "data.train_batch_size=4", "rollout.n=2",
    "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8",
    "data.task_train_size=32", "data.task_val_size=4", "rollout.max_new_tokens=32", "data.max_response_length=96",
    "sft.enable=false", "logging.progress=false",
]


def _fields(model) -> list[tuple[str, object]]:
    return [(name, object.__getattribute__(model, name)) for name in type(model).model_fields]


def _sections(model, path: str = ""):
    yield path, model
    for name, value in _fields(model):
        if hasattr(type(value), "model_fields"):
            yield from _sections(value, f"{path}{name}.")


def _leaves(cfg) -> list[str]:
    return [f"{path}{name}" for path, model in _sections(cfg) for name, value in _fields(model)
            if not hasattr(type(value), "model_fields")]


def _keys_read(cfg, monkeypatch) -> set[str]:
    """The leaf keys a one-step run of ``cfg`` reads; a read on a copy of a section counts for the
    section when its class appears once in the schema."""
    reads: set[tuple[int, str, str]] = set()

    def spy(self, name):
        if name in type(self).model_fields:
            reads.add((id(self), type(self).__name__, name))
        return object.__getattribute__(self, name)

    paths = {id(model): path for path, model in _sections(cfg)}
    by_class: dict[str, list[str]] = {}
    for path, model in _sections(cfg):
        by_class.setdefault(type(model).__name__, []).append(path)
    with monkeypatch.context() as patch:
        patch.setattr(schema.Section, "__getattribute__", spy)
        patch.setattr(health._Section, "__getattribute__", spy)
        train(cfg)
    keys = set()
    for ident, cls, name in reads:
        if ident in paths:
            keys.add(paths[ident] + name)
        elif len(by_class.get(cls, [])) == 1:
            keys.add(by_class[cls][0] + name)
    return keys


@pytest.mark.parametrize("extra", [[], ["algorithm=ppo"], ["rollout.max_staleness=1", "engine.process=false"]],
                         ids=["grpo", "ppo", "async"])
def test_every_key_is_read_by_the_run_or_inert_with_a_reason(tmp_path, monkeypatch, extra):
    cfg = load_config("train", [*ONE_STEP, f"trainer.runs_root={tmp_path}", "trainer.run_name=r", *extra])
    read = _keys_read(cfg, monkeypatch)
    silent = [k for k in _leaves(cfg) if k not in read and inert_reason(cfg, k) is None and k not in READ_WHEN]
    assert not silent, f"keys this configuration neither reads nor names as inert (agentrl/config/inert.py): {silent}"
    # the switches the rules test are never named inert themselves (setting them changes the run)
    for switch in ("critic.enable", "sft.enable", "rollout.max_staleness", "engine.backend", "actor.lora.rank"):
        assert inert_reason(cfg, switch) is None, switch


def test_the_issues_examples_are_named_with_why():
    cfg = load_config("train", ["engine.tp_size=2", "critic.optim.lr=1e-4", "rollout.stale_groups=wait", "algorithm=grpo"],
                      check_files=False)
    assert inert_overrides(cfg, ["engine.tp_size=2", "critic.optim.lr=1e-4", "rollout.stale_groups=wait", "algorithm=grpo"]) == [
        ("engine.tp_size=2", "it configures SGLang servers and engine.backend=builtin"),
        ("critic.optim.lr=1e-4", "the run has no critic (algorithm.adv_estimator=grpo; algorithm=ppo, or critic.enable=true, "
                                 "trains one)"),
        ("rollout.stale_groups=wait", "it configures asynchronous training and rollout.max_staleness=0 (synchronous)"),
    ]
    ppo = load_config("train", ["algorithm=ppo", "critic.optim.lr=1e-4"], check_files=False)
    assert inert_overrides(ppo, ["algorithm=ppo", "critic.optim.lr=1e-4"]) == []
    # verl's names are read as agentrl's
    assert inert_overrides(cfg, ["actor_rollout_ref.model.lora_alpha=32"]) == [
        ("actor_rollout_ref.model.lora_alpha=32", "actor.lora.rank=0: no adapters (full fine-tuning)")]


def test_agentrl_train_names_an_inert_key_before_any_work(monkeypatch, capsys):
    from agentrl.trainer import run

    def no_work(cfg, command):
        raise AssertionError("the run started")

    monkeypatch.setattr(run, "train", no_work)
    with pytest.raises(AssertionError, match="the run started"):
        run.cli_main(["engine.tp_size=2", "trainer.total_steps=1"])
    assert capsys.readouterr().err.endswith("agentrl train: warning: engine.tp_size=2 has no effect: it configures SGLang "
                                            "servers and engine.backend=builtin\n")
