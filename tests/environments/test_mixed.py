"""One ``agentrl train`` run whose rows belong to environments of all three libraries: a TRL
environment class, a verifiers ``ToolEnv`` and an OpenEnv environment served by OpenEnv's own
server code (``openenv_fixture:ReplyEnvironment``, in a process agentrl starts). Each row runs its
library's loop (chosen by its ``extra_info.environment``, no ``agent_name``), each trajectory is
scored by its own environment, and the one GRPO update trains on all of them, token-exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("verifiers")
pytest.importorskip("trl")
pytest.importorskip("openenv")

HERE = Path(__file__).resolve().parent

# a verifiers user's module: a ToolEnv with a calculator described as the tiny skilled base knows it
VF_ENV = '''
import verifiers as vf
from datasets import Dataset


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: the expression to evaluate, for example 4821 * 37
    """
    return str(eval(expression, {"__builtins__": {}}, {}))


def correct(completion, answer) -> float:
    return 1.0 if completion and answer in (completion[-1].content or "") else 0.0


def short(completion) -> float:
    return 1.0 if completion and len(completion[-1].content or "") % 2 else 0.0


def load_environment():
    data = Dataset.from_list([{"question": f"What is {a} * {b}?", "answer": str(a * b)} for a, b in
                              [(412, 23), (77, 96)]])
    return vf.ToolEnv(dataset=data, tools=[calculator], max_turns=3, rubric=vf.Rubric(funcs=[correct, short], weights=[1.0, 0.5]),
                      system_prompt="Use the calculator tool for arithmetic. End your answer with #### <number>.")
'''


@pytest.mark.ray
def test_one_run_trains_rows_of_a_trl_class_a_verifiers_environment_and_an_openenv_server_together(skilled_model_dir, tmp_path):
    from agentrl.data.io import write_rows
    from agentrl.data.rollout_store import RolloutStore
    from agentrl.environments import spec
    from agentrl_data_prep.tasks import generate

    (tmp_path / "vf_mixed_env.py").write_text(textwrap.dedent(VF_ENV))
    sys.path.insert(0, str(tmp_path))
    try:
        import agentrl.environments.verifiers as av

        vf_rows = av.rows(spec.EnvironmentRef(library="verifiers", name="vf_mixed_env"))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("vf_mixed_env", None)
        spec.clear_cache()
    trl_rows = [{"data_source": "trl/arith", "prompt": task["prompt"], "answer": task["reward_model"]["ground_truth"],
                 "extra_info": {"index": i, "environment": {"library": "trl", "name": "trl_env_fixture:ArithEnv"}}}
                for i, task in enumerate(generate("arith", 2, seed=5))]
    oe_rows = [{"data_source": "openenv/reply", "prompt": [{"role": "user", "content": "Play the word game."}],
                "extra_info": {"index": i, "environment": {"library": "openenv", "name": "openenv_fixture:ReplyEnvironment",
                                                           "args": {"letter": letter}}}}
               for i, letter in enumerate("ae")]
    write_rows(vf_rows + trl_rows + oe_rows, tmp_path / "rows.parquet")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", f"data.train_files=[{tmp_path / 'rows.parquet'}]",
        "data.task=null", f"model.path={skilled_model_dir}", "sft.enable=false", "trainer.total_steps=1", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.export_hf=false", "data.train_batch_size=6",
        "rollout.n=2", "rollout.max_new_tokens=48", "data.max_response_length=256", "actor.ppo_mini_batch_size=6",
        "actor.ppo_micro_batch_size_per_gpu=6",
        "environment.openenv.max_sessions=4",
        'environment.trl.reward_funcs=["trl_env_fixture:used_tools","trl_env_fixture:odd_length"]',
        f"trainer.runs_root={tmp_path}", "trainer.run_name=mixed", "logging.progress=false", "trainer.threads_per_worker=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "mixed" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [1]
    records = list(RolloutStore(tmp_path / "mixed" / "rollouts").iter_stored())
    stored = [r.trajectory for r in records]
    by_loop = {loop: [t for t in stored if t.agent_name == loop] for loop in ("trl_env", "verifiers_env", "openenv_env")}
    # the one step is the whole epoch: 2 rows of each library, 2 samples each
    assert {loop: len(ts) for loop, ts in by_loop.items()} == {"trl_env": 4, "verifiers_env": 4, "openenv_env": 4}
    assert len(stored) == 12
    assert {t.data_source for t in by_loop["trl_env"]} == {"trl/arith"}
    assert {t.data_source for t in by_loop["openenv_env"]} == {"openenv/reply"}
    assert all(t.finish_reason != "environment_error" and t.reward_info.get("error") is None for t in stored)
    for t in by_loop["trl_env"]:  # scored by the TRL functions, which only TRL rows see
        assert t.reward == t.metrics["env/used_tools"] + t.metrics["env/odd_length"] and "env/correct" not in t.metrics
        assert "env/return" not in t.metrics
    for t in by_loop["verifiers_env"]:  # scored by the rubric
        assert t.reward == pytest.approx(t.metrics["env/correct"] + 0.5 * t.metrics["env/short"]) and "env/used_tools" not in t.metrics
        assert "env/return" not in t.metrics
    letters = {r.row.extra_info.index: r.row.extra_info.environment.args["letter"] for r in records
               if r.trajectory.agent_name == "openenv_env"}
    assert sorted(letters.values()) == ["a", "e"]
    for r in records:  # scored by the OpenEnv server's step rewards, on the turns that made the actions
        t = r.trajectory
        if t.agent_name != "openenv_env":
            continue
        letter = r.row.extra_info.environment.args["letter"]
        replies = [m["content"] for m in t.messages if m["role"] == "assistant"]
        rewards = [x.reward or 0.0 for x in t.turns if x.role == "assistant"]
        assert t.reward == 0.0 and len(replies) == 2 and t.metrics["env/done"] == 1
        assert rewards == [min(reply.count(letter), 4) / 4 for reply in replies], (replies, rewards)
        assert t.metrics["env/return"] == sum(rewards) and "env/correct" not in t.metrics and "env/used_tools" not in t.metrics
    for metrics in steps:
        assert metrics["trajectories/loop_errors"] == 0 and metrics["failures/rate"] == 0.0
        # all three libraries' tokens in one update, each scored by the trainer as the engine scored it
        assert metrics["logprob_mismatch/mean"] < 1e-5 and metrics["logprob_mismatch/max"] < 1e-3
        sampled = {loop: sum(sum(t.response_mask) for t in ts) for loop, ts in by_loop.items()}
        assert all(n > 0 for n in sampled.values()), sampled
        assert metrics["tokens/sampled"] == sum(sampled.values())  # every sampled token, of every library
