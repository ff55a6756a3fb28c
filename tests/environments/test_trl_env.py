"""A TRL environment class (``GRPOTrainer(environment_factory=Cls)``, TRL 1.16) run by the
``trl_env`` loop: its tools, prompt and tool turns are TRL's own, token for token; a tool that
raises is shown as TRL shows it; reward functions with TRL's signature score the trajectory;
the environment's failures end the trajectory as ``environment_error``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
from agentrl.agent.scripted import ScriptedEngine
from agentrl.agent.setup import RolloutSetup
from agentrl.config.schema import DataConfig, EnvironmentConfig, TrainConfig, TrlEnvironmentConfig
from agentrl.data.row import Row
from agentrl.environments import spec
from agentrl.environments import trl as trl_adapter
from agentrl.errors import PluginError
from agentrl.trajectory import TrajectoryFinish

import trl_env_fixture

HERE = Path(__file__).resolve().parent
CALL_6x7 = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
CALL_1_BY_0 = '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>'
QUESTION = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "What is 6 times 7?"}]


def trl_row(name: str = "trl_env_fixture:CalculatorEnv", **columns) -> Row:
    return Row.model_validate({"data_source": "trl/calc", "prompt": QUESTION, "answer": "42", **columns,
                               "extra_info": {"index": 0, "environment": {"library": "trl", "name": name}}})


def run_scripted(tokenizer, script, rows, *, trl_cfg=None, n=1):
    cfg = TrainConfig(data=DataConfig(max_response_length=512), environment=EnvironmentConfig(trl=trl_cfg or TrlEnvironmentConfig()))
    engine = ScriptedEngine(tokenizer, script)
    ctx = build_context(engine, tokenizer, RolloutSetup.from_config(cfg), tool_names=[])
    return asyncio.run(RolloutRunner(ctx, LoopTable("single_turn")).run(rows, n=n)), ctx


@pytest.fixture(scope="module")
def trl_trainer(tiny_model_dir, tmp_path_factory):
    """TRL's own GRPOTrainer over the same class: the reference for tools, prompt and tool turns."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.response_template = qwen3_template  # TRL's parser of Qwen's <tool_call> format (the tiny model's)
    config = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=2, num_generations=2,
                        max_completion_length=16, use_cpu=True, report_to="none", save_strategy="no")
    return GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=trl_env_fixture.used_tools,
                       args=config, train_dataset=Dataset.from_list([{"prompt": QUESTION, "answer": "42"}] * 2),
                       processing_class=tokenizer, environment_factory=trl_env_fixture.CalculatorEnv)


def test_the_tools_and_their_schemas_are_trls_for_the_same_class(trl_trainer):
    from transformers.utils import get_json_schema

    env = trl_env_fixture.CalculatorEnv()
    box = trl_adapter.tool_box(env, max_parallel_calls=4, tool_timeout_s=5.0)
    trl_tools = trl_trainer._env_tools[None]
    assert [t.__name__ for t in trl_tools] == ["divide", "multiply"] == list(box.tools)
    assert box.schemas(list(box.tools)) == [get_json_schema(t) for t in trl_tools]
    assert box.schema_of("multiply")["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first factor."}


def test_a_scripted_episode_is_trls_token_stream_exactly(trl_trainer, tiny_tokenizer):
    [t], _ = run_scripted(tiny_tokenizer, {"trl/calc:0": [CALL_6x7, "The answer is 42."]}, [("trl/calc:0", trl_row())])
    assert t.agent_name == "trl_env" and t.finish_reason == "stop"
    # TRL's prompt: reset's observation appended to the last message, rendered with the env's tools
    env = trl_env_fixture.CalculatorEnv()
    observation = env.reset(prompt=QUESTION, answer="42")
    prompt = QUESTION[:-1] + [{**QUESTION[-1], "content": QUESTION[-1]["content"] + observation}]
    trl_trainer._batch_environments = [None]
    [trl_prompt_ids], _, _ = trl_trainer._tokenize_prompts([prompt])
    assert t.prompt_ids == list(trl_prompt_ids)
    assert t.messages[:2] == prompt
    # TRL's token stream: sampled turn, the tool turn as TRL renders it (masked), sampled turn
    eot = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn1 = tiny_tokenizer.encode(CALL_6x7, add_special_tokens=False) + [eot]
    tool_turn = trl_trainer._get_tool_suffix_ids([{"role": "tool", "name": "multiply", "content": "42"}])
    turn2 = tiny_tokenizer.encode("The answer is 42.", add_special_tokens=False) + [eot]
    separator = tiny_tokenizer.encode("\n", add_special_tokens=False)  # after the final <|im_end|>, as the template writes it
    assert t.response_ids == turn1 + tool_turn + turn2 + separator
    assert t.response_mask == [1] * len(turn1) + [0] * len(tool_turn) + [1] * len(turn2) + [0] * len(separator)
    assert [lp for lp, m in zip(t.logprobs, t.response_mask) if m] == [-0.5] * (len(turn1) + len(turn2))
    assert t.messages[3] == {"role": "tool", "content": "42", "name": "multiply"}
    assert [(c.name, c.arguments, c.result, c.error) for c in t.tool_calls] == [("multiply", {"a": 6, "b": 7}, "42", None)]


def test_a_method_that_raises_is_shown_as_trl_shows_it_and_counted(tiny_tokenizer):
    [t], _ = run_scripted(tiny_tokenizer, {"trl/calc:0": [CALL_1_BY_0, "I cannot divide by zero."]}, [("trl/calc:0", trl_row())])
    assert t.finish_reason == "stop"
    shown = str({"error": "division by zero"})  # TRL: result = {"error": str(e)}, content = str(result)
    assert t.messages[3] == {"role": "tool", "content": shown, "name": "divide"}
    assert t.tool_calls[0].error == "tool_exception" and t.metrics["tool_errors/tool_exception"] == 1.0


def test_trl_reward_functions_score_the_trajectory_weighted_and_are_logged(tiny_tokenizer):
    cfg = TrlEnvironmentConfig(reward_funcs=["trl_env_fixture:used_tools", "trl_env_fixture:says_answer",
                                             "trl_env_fixture:no_opinion"], reward_weights=[0.25, 2.0, 5.0])
    script = {"trl/calc:0": [CALL_6x7, "The answer is 42."], "trl/calc:1": ["It is 41."]}
    rows = [("trl/calc:0", trl_row()), ("trl/calc:1", trl_row())]
    (used, guessed), _ = run_scripted(tiny_tokenizer, script, rows, trl_cfg=cfg)
    assert used.reward == 0.25 * 1.0 + 2.0 * 1.0  # no_opinion's None is left out, as TRL's nansum does
    assert guessed.reward == 0.0
    assert used.metrics["env/used_tools"] == 1.0 and used.metrics["env/says_answer"] == 1.0
    assert "env/no_opinion" not in used.metrics and guessed.metrics["env/used_tools"] == 0.0


def test_reward_functions_are_called_once_per_group_with_trls_batch_shapes(tiny_tokenizer):
    """A function that ranks within its batch (shortest completion 1, longest 0) sees the row's 4
    samples together, as TRL calls it with its batch, so each rank is relative to the group."""
    answers = ["It is 42.", "42", "The answer is forty two, which is 42.", "42"]  # samples 1 and 3 tie as the shortest

    def script(row_id, call, request):
        return answers[int(request.session_id.rsplit("#", 1)[1])]

    cfg = TrlEnvironmentConfig(reward_funcs=["trl_env_fixture:shortest_first", "trl_env_fixture:says_answer"],
                               reward_weights=[1.0, 0.5])
    group, _ = run_scripted(tiny_tokenizer, script, [("trl/calc:0", trl_row())], trl_cfg=cfg, n=4)
    lengths = [len(t.response_ids) for t in group]
    assert lengths[1] == lengths[3] < lengths[0] < lengths[2]
    # rank: 1 - (completions shorter than mine) / 3
    assert [t.metrics["env/shortest_first"] for t in group] == [1 - 2 / 3, 1.0, 0.0, 1.0]
    assert [t.reward for t in group] == [1 - 2 / 3 + 0.5, 1.5, 0.5, 1.5]  # + 0.5 x says_answer (each says 42)
    assert [t.metrics["env/metric/batch_size"] for t in group] == [4.0] * 4  # one call saw the whole group


def test_a_member_that_failed_is_left_out_of_its_groups_reward_call(tiny_tokenizer):
    """Sample 2's engine fails: out of the loss, and out of the call, so the batch-relative rank is
    over the three members that count (1 - shorter / 2), as verifiers' group rubrics do it."""
    from agentrl.errors import EngineError

    answers = ["It is 42.", "42", None, "42"]

    def script(row_id, call, request):
        answer = answers[int(request.session_id.rsplit("#", 1)[1])]
        if answer is None:
            raise EngineError("the server went away")
        return answer

    cfg = TrlEnvironmentConfig(reward_funcs=["trl_env_fixture:shortest_first"])
    group, _ = run_scripted(tiny_tokenizer, script, [("trl/calc:0", trl_row())], trl_cfg=cfg, n=4)
    assert [t.finish_reason for t in group] == ["stop", "stop", "engine_error", "stop"]
    assert [t.metrics.get("env/shortest_first") for t in group] == [0.0, 1.0, None, 1.0]
    assert [t.metrics.get("env/metric/batch_size") for t in group] == [3.0, 3.0, None, 3.0]
    assert [t.reward for t in group] == [0.0, 1.0, 0.0, 1.0]


def test_get_reward_is_one_more_reward_function_named_after_the_class(tiny_tokenizer):
    cfg = TrlEnvironmentConfig(reward_funcs=["trl_env_fixture:says_answer"])
    [t], _ = run_scripted(tiny_tokenizer, {"trl/calc:0": [CALL_6x7, CALL_6x7, "42"]},
                          [("trl/calc:0", trl_row("trl_env_fixture:ScoredEnv"))], trl_cfg=cfg)
    assert t.metrics["env/ScoredEnv"] == 1.0 and t.metrics["env/says_answer"] == 1.0  # 0.5 * two calls
    assert t.reward == 2.0


def test_environment_failures_end_the_trajectory_as_environment_error(tiny_tokenizer):
    rows = [("trl/calc:0", trl_row("trl_env_fixture:BrokenResetEnv")), ("trl/calc:1", trl_row())]
    script = {"trl/calc:1": ["42"]}
    (broken, judged), _ = run_scripted(tiny_tokenizer, script, rows,
                                       trl_cfg=TrlEnvironmentConfig(reward_funcs=["trl_env_fixture:raises"]))
    assert broken.finish_reason == judged.finish_reason == TrajectoryFinish.ENVIRONMENT_ERROR
    assert broken.reward_info["error"] == "reset failed: RuntimeError: the simulator did not start"
    assert broken.metrics == {"env_errors/reset": 1.0} and broken.response_ids == []
    assert "ValueError: the judge is down" in judged.reward_info["error"] and judged.metrics["env_errors/reward_function"] == 1.0
    [unscored], _ = run_scripted(tiny_tokenizer, {"trl/calc:0": ["42"]}, [("trl/calc:0", trl_row())],
                                 trl_cfg=TrlEnvironmentConfig(reward_funcs=["trl_env_fixture:no_opinion"]))
    assert unscored.finish_reason == "environment_error" and unscored.metrics["env_errors/unscored"] == 1.0


def test_reset_receives_the_prompt_and_the_rows_own_columns():
    row = trl_row(level=3)
    assert trl_adapter.reset_kwargs(row) == {"prompt": QUESTION, "answer": "42", "level": 3}


def test_a_module_that_does_not_import_names_the_missing_package(tmp_path, monkeypatch):
    (tmp_path / "needs_gym.py").write_text("import gymnasium_not_here\nclass Env:\n    def reset(self, **kw): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec.clear_cache()
    # trl itself is installed: the hint points at the user's package, not at agentrl's trl-env extra
    with pytest.raises(PluginError, match=r"package 'gymnasium_not_here' is not installed.*trl is installed: is the package "
                                          r"that defines 'needs_gym:Env' installed or on PYTHONPATH\?"):
        trl_adapter.environment_class(spec.EnvironmentRef(library="trl", name="needs_gym:Env"))
    with pytest.raises(PluginError, match="defines no reset method"):
        trl_adapter.environment_class(spec.EnvironmentRef(library="trl", name="trl_env_fixture:used_tools.__class__"))
    sys.modules.pop("needs_gym", None)


def grpo_advantages(rewards: list[float]) -> list[float]:
    """agentrl's GRPO (verl's): (r - mean) / (unbiased std + 1e-6); a lone sample keeps its reward."""
    if len(rewards) < 2:
        return list(rewards)
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards]


@pytest.mark.ray
def test_agentrl_train_runs_a_trl_environment_class_token_exactly_and_its_reward_reaches_the_advantage(skilled_model_dir, tmp_path):
    from agentrl.data.io import write_rows
    from agentrl.data.rollout_store import RolloutStore

    from agentrl_data_prep.tasks import generate

    rows = []
    for i, task in enumerate(generate("arith", 8, seed=3)):  # one epoch of two steps; rows 3 and 7: reset raises
        name = "trl_env_fixture:BrokenResetEnv" if i % 4 == 3 else "trl_env_fixture:ArithEnv"
        rows.append({"data_source": "trl/calc", "prompt": task["prompt"], "answer": task["reward_model"]["ground_truth"],
                     "extra_info": {"index": i, "environment": {"library": "trl", "name": name}}})
    write_rows(rows, tmp_path / "rows.parquet")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", f"data.train_files=[{tmp_path / 'rows.parquet'}]",
        "data.task=null", f"model.path={skilled_model_dir}", "sft.enable=false", "trainer.total_steps=2", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.export_hf=false", "data.train_batch_size=4",
        "rollout.n=2", "rollout.max_new_tokens=48", "data.max_response_length=256", "actor.ppo_mini_batch_size=4",
        'environment.trl.reward_funcs=["trl_env_fixture:used_tools","trl_env_fixture:says_answer","trl_env_fixture:odd_length"]',
        "environment.trl.reward_weights=[0.5,1.0,0.25]", f"trainer.runs_root={tmp_path}", "trainer.run_name=trl",
        "logging.progress=false", "trainer.threads_per_worker=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [1, 2]
    stored = list(RolloutStore(tmp_path / "trl" / "rollouts").iter_stored())
    assert len(stored) == 16 and {s.trajectory.agent_name for s in stored} == {"trl_env"}
    broken = [s.trajectory for s in stored if s.trajectory.finish_reason == "environment_error"]
    assert len(broken) == 4 and all(t.reward_info["error"].startswith("reset failed: RuntimeError") for t in broken)
    assert sum(s.get("failures/environment_error", 0.0) for s in steps) == 4
    assert sum(s["env_errors/reset"] for s in steps if "env_errors/reset" in s) == 4
    moved = 0
    for metrics in steps:
        # token-exact: the trainer scores the stored tokens as the engine scored them
        assert metrics["logprob_mismatch/mean"] < 1e-5 and metrics["logprob_mismatch/max"] < 1e-3
        here = [s.trajectory for s in stored if s.step == metrics["step"]]
        good = [t for t in here if t.finish_reason != "environment_error"]
        for t in good:  # the TRL functions' weighted sum is the reward
            assert t.reward == pytest.approx(0.5 * t.metrics["env/used_tools"] + t.metrics["env/says_answer"]
                                             + 0.25 * t.metrics["env/odd_length"])
            assert t.metrics["env/odd_length"] == float(len(t.response_ids) % 2)
        assert metrics["env/odd_length"] == pytest.approx(sum(t.metrics["env/odd_length"] for t in good) / len(good))
        # the reward reached the advantage: GRPO over each group's scored samples, by hand
        advantages, tokens = [], []
        for group in sorted({t.group_id for t in good}):
            members = [t for t in good if t.group_id == group]
            advantages += grpo_advantages([t.reward for t in members])
            tokens += [sum(t.response_mask) for t in members]
        assert metrics["tokens/sampled"] == sum(tokens)
        assert metrics["advantages/abs_max"] == pytest.approx(max(abs(a) for a, n in zip(advantages, tokens) if n), abs=1e-5)
        assert metrics["advantages/mean"] == pytest.approx(sum(a * n for a, n in zip(advantages, tokens)) / sum(tokens), abs=1e-5)
        moved += sum(abs(a) > 0.5 for a in advantages)
    assert moved >= 2  # some group's samples were scored differently: the check above is not all zeros
    good = [s.trajectory for s in stored if s.trajectory.finish_reason != "environment_error"]
    # the model called the environment's method (the skilled base knows a calculator) and was scored for it
    assert any(t.metrics["env/used_tools"] == 1.0 for t in good) and any(c.name == "calculator" and c.error is None
                                                                      for t in good for c in t.tool_calls)


def test_the_reward_functions_are_checked_with_the_config():
    from agentrl.config import validate_config
    from agentrl.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate_config({"environment": {"trl": {"reward_funcs": ["trl_env_fixture:used_tools", "trl_env_fixture:nope"]}}},
                        check_files=False)
    problems = dict(err.value.problems)
    assert list(problems) == ["environment.trl.reward_funcs.1"] and "has no attribute 'nope'" in problems["environment.trl.reward_funcs.1"]
    with pytest.raises(ConfigError, match="reward_weights has 1 weights for 2 reward_funcs"):
        validate_config({"environment": {"trl": {"reward_funcs": ["trl_env_fixture:used_tools", "trl_env_fixture:odd_length"],
                                                 "reward_weights": [1.0]}}}, check_files=False)
