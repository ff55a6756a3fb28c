"""A verl user's command line runs unchanged: every key of verl's GSM8K multi-turn example
scripts is mapped onto agentrl's setting, accepted with one warning saying why it has no effect,
or refused with the reason; and docs/verl.md lists exactly the table's keys."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.config.verl import VERL_KEYS, VERL_PREFIXES, translate
from agentrl.errors import ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "verl.md"

# verl's examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh and its _w_interaction and
# _tool_agent variants, as a user would paste them (model and data paths replaced by local ones)
VERL_SCRIPT = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=4",
    "data.max_prompt_length=1024",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation='error'",
    "data.return_raw_chat=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "+actor_rollout_ref.model.enable_activation_offloading=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=sglang",
    "actor_rollout_ref.rollout.mode=async",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.multi_turn.enable=True",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
    "actor_rollout_ref.rollout.multi_turn.format=hermes",
    "actor_rollout_ref.rollout.trace.backend=mlflow",
    "actor_rollout_ref.rollout.trace.token2text=True",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.logger=['console']",
    "trainer.project_name='gsm8k_async_rl'",
    "trainer.experiment_name='qwen2.5-3b_function_rm-gsm8k-sgl-multi-w-tool-verify-n16'",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=-1",
    "trainer.test_freq=20",
    "trainer.total_training_steps=2",
]


def test_verl_gsm8k_multiturn_script_overrides_compose_into_agentrl_settings(caplog):
    with caplog.at_level(logging.WARNING, logger="agentrl.config.loader"):
        cfg = load_config("train", VERL_SCRIPT, check_files=False)
    assert cfg.algorithm.adv_estimator == "grpo"
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (4, 1024, 1024)
    assert cfg.actor.optim.lr == 1e-6
    assert (cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) == (True, 0.001, "low_var_kl")
    assert cfg.model.gradient_checkpointing is True
    assert (cfg.rollout.n, cfg.agent.max_assistant_turns, cfg.agent.tool_parser) == (4, 5, "hermes")
    assert cfg.trainer.save_freq == 0  # verl's -1: never
    assert cfg.trainer.test_freq == 20 and cfg.trainer.total_steps == 2
    assert cfg.logging.loggers == ["console"] and cfg.logging.project == "gsm8k_async_rl"
    assert cfg.trainer.run_name == "qwen2.5-3b_function_rm-gsm8k-sgl-multi-w-tool-verify-n16"
    warned = [r.getMessage() for r in caplog.records]
    # one line per key that has no effect, saying which key and why
    assert any(m.startswith("agentrl: actor_rollout_ref.rollout.mode=async: accepted, no effect in agentrl: ") for m in warned)
    assert any(m.startswith("agentrl: actor_rollout_ref.actor.fsdp_config.param_offload=False: accepted, no effect") for m in warned)
    no_effect = [o for o in VERL_SCRIPT if isinstance(translate(*o.lstrip("+").split("=", 1)).warning, str)]
    assert len(warned) == len(no_effect) == 19


def test_a_single_train_file_string_is_a_list_of_one(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_bytes(b"")
    cfg = load_config("train", [f"data.train_files={path}", f"data.val_files={path}"], check_files=False)
    assert cfg.data.train_files == [str(path)] and cfg.data.val_files == [str(path)]
    cfg = load_config("train", [f"data.train_files=[{path},{path}]"], check_files=False)
    assert cfg.data.train_files == [str(path), str(path)]


def test_refused_verl_options_are_errors_naming_the_key_with_what_to_do():
    with pytest.raises(ConfigError) as err:
        load_config("train", ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "custom_reward_function.path=r.py"],
                    check_files=False)
    problems = dict(err.value.problems)
    assert problems["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"].endswith("give actor.optim.lr_warmup_steps (a step count) instead")
    assert "agentrl.rewards` entry point" in problems["custom_reward_function.path"]


def test_keys_in_neither_verl_nor_agentrl_get_a_correct_suggestion():
    with pytest.raises(ConfigError) as err:
        load_config("train", ["actor_rollout_ref.actor.clip_ratoi=0.2"], check_files=False)
    assert dict(err.value.problems) == {"actor.clip_ratoi": "unknown key; did you mean actor.clip_ratio?"}


def test_verl_sentinel_minus_one_is_never_also_under_agentrl_names():
    cfg = load_config("train", ["trainer.save_freq=-1", "trainer.test_freq=-1"], check_files=False)
    assert (cfg.trainer.save_freq, cfg.trainer.test_freq) == (0, 0)


def test_every_mapped_target_is_a_schema_key():
    from agentrl.config.help import config_keys

    keys = {key for key, *_ in config_keys()}
    targets = {rule.target for rule in VERL_KEYS.values() if hasattr(rule, "target")}
    assert targets - keys == set()


def _documented_keys() -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", DOCS.read_text(), flags=re.M))


def test_docs_verl_md_lists_exactly_the_table():
    table = set(VERL_KEYS) | {prefix + "*" for prefix, _ in VERL_PREFIXES}
    documented = _documented_keys()
    assert table - documented == set(), "in the table but not in docs/verl.md"
    assert documented - table == set(), "in docs/verl.md but not in the table"


def test_verls_lora_keys_set_the_actors_lora():
    cfg = load_config("train", ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
                                "actor_rollout_ref.model.target_modules=all-linear"], check_files=False)
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha, cfg.actor.lora.target_modules) == (8, 32.0, ["all-linear"])
    cfg = load_config("train", ["actor_rollout_ref.model.target_modules=[q_proj,v_proj]"], check_files=False)
    assert (cfg.actor.lora.rank, cfg.actor.lora.target_modules) == (0, ["q_proj", "v_proj"])  # rank 0: off, as in verl
