"""The composed config is validated before any work: every problem at once, each naming its key."""

from __future__ import annotations

import pytest

from agentrl.config import compose, load_config, validate_config
from agentrl.config.schema import TrainConfig
from agentrl.errors import ConfigError


def problems_of(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("train", overrides)
    return dict(info.value.problems)


def test_default_train_config_is_the_quickstart():
    cfg = load_config("train")
    assert cfg.data.task == "arith"
    assert cfg.model.path is None and cfg.model.tiny.size == "1m"
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.critic.enable is False
    assert cfg.agent.default_loop == "single_turn"  # verl's default for rows without agent_name


def test_group_override_switches_to_ppo_with_a_critic():
    cfg = load_config("train", ["algorithm=ppo"])
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.algorithm.lam == 0.95
    assert cfg.critic.enable is True


def test_a_data_config_brings_its_base_after_the_trainers_defaults_and_a_key_on_the_command_line_wins():
    # configs/_data_defaults/solver_verifier.yaml: its verifier needs the checking base, which
    # trainer=quickstart (applied after the data group) would otherwise set back to calculator
    assert compose("train", ["data=solver_verifier"])["model"]["tiny"]["skills"] == "checking"
    assert compose("train", ["data=arith"])["model"]["tiny"]["skills"] == "calculator"  # no specialisation
    assert compose("train", ["data=solver_verifier", "model.tiny.skills=calculator"])["model"]["tiny"]["skills"] == "calculator"
    assert compose("sft", ["data=solver_verifier"])["model"]["tiny"]["skills"] == "checking"  # the warm start's command too


def test_dotted_override_sets_a_key_no_yaml_mentions():
    cfg = load_config("train", ["actor.clip_ratio_high=0.28", "agent.tool_config.calculator.precision=4"])
    assert cfg.actor.clip_ratio_high == 0.28
    assert cfg.agent.tool_config == {"calculator": {"precision": 4}}


def test_verl_dotted_names_are_translated():
    cfg = load_config(
        "train",
        [
            "actor_rollout_ref.actor.clip_ratio=0.3",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.optim.lr=3e-6",
            "algorithm.kl_ctrl.kl_coef=0.01",
            "critic.optim.lr=2e-5",
            "trainer.critic_warmup=3",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_type=k3",
        ],
    )
    assert cfg.actor.clip_ratio == 0.3
    assert cfg.rollout.n == 8
    assert cfg.actor.optim.lr == 3e-6
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.01
    assert cfg.critic.optim.lr == 2e-5
    assert cfg.trainer.critic_warmup == 3
    assert cfg.use_reference is True


def test_unsupported_verl_option_is_named():
    problems = problems_of(["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"])
    assert problems == {
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "this verl option is not supported by agentrl: "
        "give actor.optim.lr_warmup_steps (a step count) instead"
    }


def test_unknown_key_is_named_with_a_suggestion():
    problems = problems_of(["data.train_batch_sise=8"])
    assert problems == {"data.train_batch_sise": "unknown key; did you mean data.train_batch_size?"}


def test_unknown_nested_key_names_its_full_path():
    problems = problems_of(["actor.optim.learning_rate=1e-4"])
    assert list(problems) == ["actor.optim.learning_rate"]
    assert problems["actor.optim.learning_rate"].startswith("unknown key")


def test_wrong_type_names_the_key_and_the_value():
    problems = problems_of(["rollout.n=many"])
    assert "rollout.n" in problems
    assert "'many'" in problems["rollout.n"]


def test_out_of_range_value_is_reported():
    problems = problems_of(["rollout.top_p=1.5"])
    assert "rollout.top_p" in problems
    assert "less than or equal to 1" in problems["rollout.top_p"]


def test_mini_batch_that_does_not_divide_the_batch_is_reported():
    problems = problems_of(["data.train_batch_size=16", "actor.ppo_mini_batch_size=6", "rollout.n=4"])
    assert problems["actor.ppo_mini_batch_size"] == (
        "actor.ppo_mini_batch_size × rollout.n = 24 trajectories does not divide "
        "data.train_batch_size × rollout.n = 64"
    )


def test_micro_batch_must_divide_the_per_rank_mini_batch():
    problems = problems_of(["actor.ppo_mini_batch_size=4", "rollout.n=3", "actor.world_size=2", "actor.ppo_micro_batch_size_per_gpu=4"])
    assert "actor.ppo_micro_batch_size_per_gpu" in problems
    assert "6 trajectories" in problems["actor.ppo_micro_batch_size_per_gpu"]


def test_critic_batch_sizes_are_checked_only_when_the_critic_runs():
    load_config("train", ["critic.ppo_mini_batch_size=7"])  # GRPO: no critic, no complaint
    problems = problems_of(["algorithm=ppo", "critic.ppo_mini_batch_size=7"])
    assert "critic.ppo_mini_batch_size" in problems


def test_missing_files_are_named(tmp_path):
    missing = tmp_path / "nope.parquet"
    problems = problems_of([f"data.train_files=[{missing}]", f"model.path={tmp_path}", f"trainer.resume={tmp_path}/run"])
    assert problems["data.train_files.0"] == f"file not found: {missing}"
    assert problems["model.path"].startswith("not a transformers checkpoint directory")
    assert problems["trainer.resume"] == f"run directory not found: {tmp_path}/run"


def test_unknown_plugin_names_are_reported_before_work():
    problems = problems_of(["agent.default_loop=nonexistent_loop", "reward.default=nope"])
    assert "no plugin named 'nonexistent_loop' in group agentrl.agent_loops" in problems["agent.default_loop"]
    assert "no plugin named 'nope' in group agentrl.rewards" in problems["reward.default"]


def test_every_problem_is_reported_at_once(tmp_path):
    problems = problems_of(
        [
            "data.train_batch_sise=8",  # unknown key
            "rollout.temperature=hot",  # wrong type
            "actor.ppo_mini_batch_size=5",  # inconsistent number
            f"data.val_files=[{tmp_path}/val.parquet]",  # missing file
            "agent.tool_parser=nonexistent",  # unknown plugin
        ]
    )
    assert {
        "data.train_batch_sise",
        "rollout.temperature",
        "actor.ppo_mini_batch_size",
        "data.val_files.0",
        "agent.tool_parser",
    } <= set(problems)


def test_config_error_message_lists_each_key_on_its_own_line():
    with pytest.raises(ConfigError) as info:
        load_config("train", ["data.bogus=1", "rollout.bogus=2"])
    text = str(info.value)
    assert text.startswith("invalid configuration (2 problems):")
    assert "\n  data.bogus: unknown key" in text
    assert "\n  rollout.bogus: unknown key" in text


def test_malformed_override_is_reported():
    with pytest.raises(ConfigError) as info:
        load_config("train", ["data.train_batch_size"])
    assert info.value.problems == [("data.train_batch_size", "an override must look like key=value")]


def test_schema_defaults_match_an_empty_config():
    # Defaults live in the schema: validating {} gives the schema's defaults.
    assert validate_config({}, check_files=False) == TrainConfig()


def test_every_shipped_yaml_config_validates():
    for name, overrides in [
        ("train", []),
        ("rollout", []),
        ("sft", []),
        ("train", ["algorithm=ppo"]),
        ("train", ["algorithm=rloo"]),
        ("train", ["algorithm=reinforce_plus_plus"]),
        ("train", ["agent=react"]),
        ("train", ["agent=single_turn"]),
        ("train", ["data=word"]),
        ("train", ["data=arith_retry"]),
        ("train", ["engine=sglang"]),
        ("train", ["trainer=default"]),
    ]:
        validate_config(compose(name, overrides), check_files=False)


@pytest.mark.parametrize(
    "total_steps, total_epochs, steps_per_epoch, planned",
    [(20, None, 3, 20), (20, 2, 3, 6), (5, 2, 3, 5), (6, 2, 3, 6), (0, 1, 3, 0)],
)
def test_total_epochs_caps_the_steps_as_in_verl(total_steps, total_epochs, steps_per_epoch, planned):
    epochs = "null" if total_epochs is None else total_epochs
    trainer = load_config("train", [f"trainer.total_steps={total_steps}", f"trainer.total_epochs={epochs}"]).trainer
    assert trainer.planned_steps(steps_per_epoch) == planned


def test_total_epochs_is_at_least_one_pass():
    assert problems_of(["trainer.total_epochs=0"])["trainer.total_epochs"].startswith("Input should be greater than or equal to 1")


@pytest.mark.parametrize("key", ["model.dtype", "trainer.colocate"])  # engine.servers, engine.max_retries: read again (engine=sglang)
def test_removed_knobs_are_unknown_keys(key):
    assert problems_of([f"{key}=1"])[key].startswith("unknown key")


def test_gae_on_its_own_turns_the_critic_on_and_gae_without_a_critic_is_refused():
    # the critic-free presets leave critic.enable unset, so the estimator decides
    assert load_config("train", ["algorithm.adv_estimator=gae"], check_files=False).critic.enable is True
    assert load_config("train", ["algorithm=dapo"], check_files=False).critic.enable is False
    problems = problems_of(["algorithm.adv_estimator=gae", "critic.enable=false"])
    assert problems["critic.enable"].startswith("is false, but algorithm.adv_estimator=gae needs the critic's values")


def test_a_command_that_trains_nothing_is_not_refused_for_trainings_batch_relations(tmp_path):
    # agentrl rollout engine=sglang data.train_batch_size=8: the actor's mini-batch (16) is not its business
    overrides = ["engine=sglang", "data.train_batch_size=8", "algorithm.adv_estimator=gae", "critic.enable=false",
                 f"trainer.resume={tmp_path}/run",
                 f"sft.train_files=[{tmp_path}/sft.parquet]"]
    cfg = load_config("rollout", overrides, training=False)
    assert cfg.data.train_batch_size == 8 and cfg.actor.ppo_mini_batch_size == 16
    with pytest.raises(ConfigError) as info:
        load_config("rollout", overrides)  # the same config for a command that trains
    problems = dict(info.value.problems)
    assert problems["actor.ppo_mini_batch_size"] == "is 16, larger than data.train_batch_size = 8"
    assert problems["critic.enable"].startswith("is false, but algorithm.adv_estimator=gae needs the critic's values")
    assert problems["trainer.resume"] == f"run directory not found: {tmp_path}/run"
    assert problems["sft.train_files.0"] == f"file not found: {tmp_path}/sft.parquet"
    # what a rollout does use is still checked
    with pytest.raises(ConfigError) as info:
        load_config("rollout", overrides + ["rollout.max_new_tokens=4096", "data.max_response_length=64",
                                            f"data.train_files=[{tmp_path}/rows.parquet]"], training=False)
    assert set(dict(info.value.problems)) == {"rollout.max_new_tokens", "data.train_files.0"}


def test_rollouts_cfg_job_shows_a_config_that_training_would_refuse():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "rollout", "engine=sglang", "data.train_batch_size=8", "--cfg", "job"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "train_batch_size: 8" in done.stdout


def test_a_misspelt_group_option_lists_the_options_and_the_closest_one(capsys):
    """Not Hydra's traceback: the group's options, as an unknown key gets its closest key."""
    from agentrl.cli import main

    with pytest.raises(ConfigError) as info:
        compose("train", ["algorithm=grpoo", "engine=zzz", "agent=react"])
    assert info.value.problems == [
        ("algorithm", "unknown option 'grpoo' (known: cispo, dapo, drgrpo, grpo, gspo, ppo, reinforce_plus_plus, rloo); "
                      "did you mean algorithm=grpo?"),
        ("engine", "unknown option 'zzz' (known: builtin, scripted, sglang)"),
    ]
    assert main(["train", "--cfg", "job", "data=gsm9k"]) == 1  # exits as every configuration error does
    assert capsys.readouterr().err == (
        "agentrl train: invalid configuration (1 problem):\n"
        "  data: unknown option 'gsm9k' (known: arith, arith_retry, gsm8k, solver_verifier, word, word_steps); did you mean data=gsm8k?\n"
    )


def test_cfg_job_prints_plain_yaml_that_reads_back_as_the_config(capsys):
    """``rollout.n`` is ``n: 4``, not OmegaConf's ``'n': 4`` (YAML 1.1's one-letter boolean, which
    neither PyYAML nor OmegaConf reads as one); a string a reader would take for a number stays quoted."""
    import json

    import yaml
    from omegaconf import OmegaConf

    from agentrl.config.help import config_command_main

    overrides = ["rollout.n=4", "trainer.run_name='1e5'"]
    assert config_command_main("train", ["--cfg", "job", *overrides], "") == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "  n: 4" in lines and "  run_name: '1e5'" in lines and "'n'" not in text
    expected = json.loads(load_config("train", overrides, check_files=False).model_dump_json())
    assert yaml.safe_load(text) == expected == OmegaConf.to_container(OmegaConf.create(text))
