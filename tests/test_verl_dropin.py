"""A verl user's files and command line, unchanged: parquet rows written as verl's four GSM8K
preprocessing scripts write them (plain, multi-turn with tool, with interaction, tool agent loop),
verl's tool and interaction YAML, and verl's dotted overrides, through ``agentrl rollout`` and two
steps of ``agentrl train`` on the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl.data.rollout_store import RolloutStore

PROBLEMS = [  # made-up GSM8K-style problems (question, verl's raw answer with its "#### " line)
    ("Tom has 3 boxes of 12 pens. How many pens does he have?", "3 boxes * 12 pens = <<3*12=36>>36 pens\n#### 36"),
    ("A shop sold 48 apples on Monday and half as many on Tuesday. How many in all?", "48 / 2 = 24\n48 + 24 = 72\n#### 72"),
]
INSTRUCTION = "Let's think step by step and output the final answer after `####`."
TOOL_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. Reasoning step by step before "
    "any tool call. You should use the `calc_gsm8k_reward` tool after step by step solving the question, before generate "
    "final answer at least once and refine your answer if necessary. Put your final answer in the format of `#### <answer>`."
)
INTERACTION_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. You should rethinking carefully "
    "if user point out your answer is wrong. Put your final answer in the format of `#### <answer>`."
)
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "verl"  # verl's own tool and interaction YAML
TOOL_YAML = (FIXTURES / "gsm8k_tool_config.yaml").read_text()
INTERACTION_YAML = (FIXTURES / "gsm8k_interaction_config.yaml").read_text()


def verl_rows(variant: str) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k*.py build them (``process_fn``)."""
    rows = []
    for idx, (question_raw, answer_raw) in enumerate(PROBLEMS):
        question, solution = question_raw + " " + INSTRUCTION, answer_raw.split("#### ")[1]
        extra = {"split": "train", "index": idx, "answer": answer_raw, "question": question_raw}
        row = {"data_source": "openai/gsm8k", "ability": "math", "reward_model": {"style": "rule", "ground_truth": solution}}
        if variant == "plain":  # gsm8k.py
            row["prompt"] = [{"role": "user", "content": question}]
        elif variant in ("tool", "tool_agent_loop"):  # gsm8k_multiturn_w_tool.py, gsm8k_tool_agent_loop.py
            if variant == "tool_agent_loop":
                row["agent_name"] = "tool_agent"
            row["prompt"] = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": question}]
            extra.update(need_tools_kwargs=True,
                         tools_kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
                         interaction_kwargs={"query": question, "ground_truth": solution})
        else:  # gsm8k_multiturn_w_interaction.py
            row["prompt"] = [{"role": "system", "content": INTERACTION_SYSTEM}, {"role": "user", "content": question}]
            extra["interaction_kwargs"] = {"name": "gsm8k", "query": question, "ground_truth": solution}
        row["extra_info"] = extra
        rows.append(row)
    return rows


VARIANTS = ("plain", "tool", "interaction", "tool_agent_loop")


@pytest.fixture(scope="module")
def verl_files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("verl")
    files = {}
    for variant in VARIANTS:
        # HF datasets' to_parquet, as verl's scripts call it, writes through pyarrow: nested dicts as structs
        files[variant] = str(root / f"{variant}.parquet")
        pq.write_table(pa.Table.from_pylist(verl_rows(variant)), files[variant])
    (root / "gsm8k_tool_config.yaml").write_text(TOOL_YAML)
    (root / "gsm8k_interaction_config.yaml").write_text(INTERACTION_YAML)
    files["tool_yaml"] = str(root / "gsm8k_tool_config.yaml")
    files["interaction_yaml"] = str(root / "gsm8k_interaction_config.yaml")
    return files


def agentrl(command: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    return subprocess.run([sys.executable, "-m", "agentrl.cli", command, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env=env)


def verl_overrides(files: dict[str, str], model: Path) -> list[str]:
    """The overrides of verl's run_qwen2.5-3b_gsm8k_multiturn*.sh, sized down for the tiny model."""
    return [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=1024", "data.max_response_length=64",
        "data.filter_overlong_prompts=True", "data.truncation='error'", "data.return_raw_chat=True",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.response_length=16",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.logger=['console']",
        "trainer.project_name='gsm8k_async_rl'", "trainer.experiment_name='verl-dropin'", "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1", "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.total_training_steps=2",
        "trainer.total_epochs=15",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={files['tool_yaml']}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={files['interaction_yaml']}",
    ]


def rollout_by_system(verl_files, model, tmp_path, variants, extra=()) -> dict:
    """``agentrl rollout`` over the variants' files; (loop, offers verl's tool, offers the calculator)
    of its trajectories, by the row's system prompt (None: the plain variant's)."""
    files = "[" + ",".join(verl_files[v] for v in variants) + "]"
    name = "-".join(variants)
    done = agentrl("rollout", verl_overrides(verl_files, model) + [*extra,
        f"data.train_files={files}", f"trainer.runs_root={tmp_path}", f"trainer.run_name={name}", "logging.progress=false",
    ], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    stored = list(RolloutStore(tmp_path / name / "rollouts").iter_stored())
    assert len(stored) == len(variants) * len(PROBLEMS) * 2
    by_system: dict = {}
    for s in stored:
        t = s.trajectory
        assert t.finish_reason not in ("loop_error", "engine_error", "interaction_error", "abort"), t.reward_info
        prompt = tok.decode(t.prompt_ids)
        system = s.row.prompt[0].content if s.row.prompt[0].role == "system" else None
        assert s.row.prompt[-1].content in prompt  # the stored row is this trajectory's own
        by_system.setdefault(system, set()).add((str(t.agent_name), '"name": "calc_gsm8k_reward"' in prompt, "calculator" in prompt))
    return by_system


def test_verls_plain_and_tool_agent_loop_variants_roll_out_with_verls_defaults(verl_files, tiny_model_dir, tmp_path):
    by_system = rollout_by_system(verl_files, tiny_model_dir, tmp_path, ("plain", "tool_agent_loop"))
    assert by_system == {
        None: {("single_turn", False, False)},  # no agent_name: verl's default single turn, no tools
        TOOL_SYSTEM: {("tool_agent", True, False)},  # exactly the YAML's tool
    }


def test_verls_tool_and_interaction_variants_roll_out_with_the_tool_agent_as_default_loop(verl_files, tiny_model_dir, tmp_path):
    # their rows name no loop: a verl user of the agent loops sets the default one
    by_system = rollout_by_system(verl_files, tiny_model_dir, tmp_path, ("tool", "interaction"),
                                  ["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"])
    assert by_system == {TOOL_SYSTEM: {("tool_agent", True, False)}, INTERACTION_SYSTEM: {("tool_agent", True, False)}}


def test_two_verl_training_steps_on_the_four_variants(verl_files, tiny_model_dir, tmp_path):
    files = "[" + ",".join(verl_files[v] for v in VARIANTS) + "]"
    done = agentrl("train", verl_overrides(verl_files, tiny_model_dir) + [
        f"data.train_files={files}", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", "trainer.val_before_train=False", f"trainer.runs_root={tmp_path}",
        "trainer.run_name=verl", "logging.progress=false", "trainer.threads_per_worker=1",
        # verl's LoRA recipe (run_qwen2_5-3b_gsm8k_grpo_lora.sh) spells LoRA so
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16", "actor_rollout_ref.model.target_modules=all-linear",
    ], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "verl" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]  # trainer.total_training_steps=2 (before total_epochs=15)
    assert all(r["trajectories/loop_errors"] == 0 for r in steps)
    assert not (tmp_path / "verl" / "checkpoints").exists() or not list((tmp_path / "verl" / "checkpoints").iterdir())  # save_freq=-1
    assert "accepted, no effect in agentrl" in done.stderr  # verl's engine keys said so, once each
    summary = json.loads((tmp_path / "verl" / "summary.json").read_text())
    assert 0 < summary["actor/trainable_parameters"] < summary["actor/parameters"] / 10  # the adapters alone train
    assert "parameters train (LoRA rank 8 on all-linear)" in done.stderr + done.stdout


def test_verls_interaction_variant_gets_verls_retry_reply(verl_files, tiny_tokenizer):
    """The interaction variant's row through the loops (scripted answers): verl's texts."""
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.scripted import ScriptedEngine
    from agentrl.agent.setup import RolloutSetup
    from agentrl.config import load_config
    from agentrl.data.dataset import parse_row

    cfg = load_config("rollout", [f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={verl_files['interaction_yaml']}"],
                      check_files=False)
    row = parse_row(verl_rows("interaction")[1], file="interaction.parquet", index=1)
    engine = ScriptedEngine(tiny_tokenizer, {"r": ["48 + 24 = 70\n#### 70", "48 + 24 = 72\n#### 72"]})
    ctx = build_context(engine, tiny_tokenizer, RolloutSetup.from_config(cfg))
    [t] = asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run([("r", row)]))
    users = [m["content"] for m in t.messages if m["role"] == "user"][1:]
    assert users == ["Your response is incorrect! You need to reflect on your answer and try again.", "Your response is correct!"][:len(users)]
    assert t.finish_reason == "interaction_done" and t.reward == 1.0
