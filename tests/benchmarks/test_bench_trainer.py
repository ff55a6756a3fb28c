"""`agentrl bench trainer --json` runs end to end and prints one JSON object (a smoke check of
the command, with tiny settings; the figures themselves are in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_bench_trainer_prints_one_json_object_with_both_sides_and_leaves_no_files(tmp_path):
    """One repeat per side, TRL's too (trl is in the test extra: the comparison runs in CI, with
    real timings on both sides); the repeats' summary is checked below without training. Run with a
    fresh TMPDIR, which must be empty afterwards: the work directory, the run directories and
    the private Ray cluster's files are all removed (the caches that outlive a run on purpose,
    tiny models and torch's compile cache, are pointed elsewhere)."""
    fresh = Path(tempfile.mkdtemp(prefix="t"))  # short: Ray's unix socket paths under it are capped at 107 bytes
    env = {**os.environ, "TMPDIR": str(fresh), "AGENTRL_CACHE": str(tmp_path / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("RAY_TMPDIR", None)
    args = ["--steps", "2", "--prompts", "2", "--n", "4", "--max-new-tokens", "4", "--eval-prompts", "4", "--eval-samples", "2", "--repeats", "1"]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "bench", "trainer", "--json", *args], env=env, capture_output=True, text=True, timeout=600
        )
        left = sorted(os.listdir(fresh))
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert left == []
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout[-2000:]  # TRL's own logs go to stderr
    out = json.loads(lines[0])
    assert out["settings"]["steps"] == 2 and out["settings"]["n"] == 4
    assert out["repeats"] == 1 and out["order"] == ["agentrl", "trl"]
    for side in ("agentrl", "trl"):
        assert len(out[f"{side}_train_rewards"]) == 2
        assert out[f"{side}_step_s"] > 0 and 0.0 <= out[f"{side}_reward"] <= 1.0
        assert out[f"{side}_step_s_all"] == [out[f"{side}_step_s"]] and out[f"{side}_e2e_s_min"] == out[f"{side}_e2e_s_max"]
        # the whole process against the training call inside it: start-up is counted
        assert out[f"{side}_e2e_s"] > out[f"{side}_train_wall_s"] > out[f"{side}_step_s"]
        assert out[f"{side}_outside_train_s"] == pytest.approx(out[f"{side}_e2e_s"] - out[f"{side}_train_wall_s"], abs=1e-3)
    assert out["ratio"] == pytest.approx(out["trl_step_s"] / out["agentrl_step_s"], rel=1e-2)  # the figures are rounded to 4 decimals
    assert out["e2e_ratio"] == pytest.approx(out["trl_e2e_s"] / out["agentrl_e2e_s"], rel=1e-2)
    assert out["trl_version"]
    # agentrl's start-up phases: one rank, so its groups were built in its process (no Ray phase)
    startup = out["agentrl_startup_s"]
    assert "ray" not in startup and startup["actor_workers"] > 0
    assert startup["total"] == pytest.approx(sum(v for k, v in startup.items() if k != "total"), abs=0.01)


def test_the_sides_alternate_which_goes_first():
    from agentrl_benchmarks.trainer import SIDES, _side_order

    assert [f"{r}:{side}" for r, side in _side_order(4, SIDES)] == [
        "0:agentrl", "0:trl", "1:trl", "1:agentrl", "2:agentrl", "2:trl", "3:trl", "3:agentrl",
    ]
    assert _side_order(2, SIDES[:1]) == [(0, "agentrl"), (1, "agentrl")]


def test_repeats_are_summarised_by_median_min_and_max(tmp_path, monkeypatch):
    """The summary of three runs per side, from hand-made runs: each key is the median, the spread
    keys hold min, max and every run in running order."""
    import types

    import agentrl.tiny
    from agentrl_benchmarks import trainer as bench

    step_times = {"agentrl": [0.30, 0.10, 0.20], "trl": [0.50, 0.70, 0.60]}  # by repeat
    e2e = {"agentrl": [9.0, 8.0, 10.0], "trl": [2.0, 1.0, 3.0]}
    rewards = {"agentrl": [0.8, 0.9, 0.7], "trl": [0.6, 0.5, 0.7]}
    ran: list[str] = []

    def fake_process(side, start, work, settings):
        repeat = int(work.name.split("-")[1])
        ran.append(f"{repeat}:{side}")
        step = step_times[side][repeat]
        return {"step_times": [5.0, step, step], "tokens": [64.0, 32.0, 32.0], "train_rewards": [0.1, 0.2, 0.3],
                "wall_s": e2e[side][repeat] - 1.0, "e2e_s": e2e[side][repeat], "policy": Path(f"{side}/{repeat}")}

    monkeypatch.setattr(agentrl.tiny, "tiny_model_dir", lambda size, seed: tmp_path / "tiny")
    monkeypatch.setattr(bench, "warm_start", lambda model_dir, out, settings: out)
    monkeypatch.setattr(bench, "_run_side_process", fake_process)
    monkeypatch.setattr(bench, "evaluate", lambda path, settings, work: 0.5 if path.name == "start" else rewards[path.parent.name][int(path.name)])
    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(__version__="9.9"))
    out = bench._run_both(bench.Settings(steps=3), tmp_path, with_trl=True)

    assert ran == ["0:agentrl", "0:trl", "1:trl", "1:agentrl", "2:agentrl", "2:trl"]
    assert out["order"] == ["agentrl", "trl", "trl", "agentrl", "agentrl", "trl"] and out["repeats"] == 3
    assert out["start_reward"] == 0.5 and out["trl_version"] == "9.9"
    assert (out["agentrl_step_s"], out["agentrl_step_s_min"], out["agentrl_step_s_max"]) == pytest.approx((0.20, 0.10, 0.30))
    assert out["agentrl_step_s_all"] == pytest.approx([0.30, 0.10, 0.20])
    assert (out["trl_step_s"], out["trl_step_s_min"], out["trl_step_s_max"]) == pytest.approx((0.60, 0.50, 0.70))
    assert (out["agentrl_e2e_s"], out["agentrl_e2e_s_min"], out["agentrl_e2e_s_max"]) == (9.0, 8.0, 10.0)
    assert (out["trl_e2e_s"], out["trl_e2e_s_min"], out["trl_e2e_s_max"]) == (2.0, 1.0, 3.0)
    assert out["agentrl_outside_train_s"] == 1.0 and out["agentrl_train_wall_s"] == 8.0
    assert (out["agentrl_reward"], out["agentrl_reward_all"]) == (0.8, [0.8, 0.9, 0.7])
    assert (out["trl_reward"], out["trl_reward_min"], out["trl_reward_max"]) == (0.6, 0.5, 0.7)
    assert out["agentrl_first_step_s"] == 5.0 and out["agentrl_tokens_per_s"] == pytest.approx(64.0 / 0.4)
    assert out["ratio"] == pytest.approx(0.60 / 0.20) and out["e2e_ratio"] == pytest.approx(2.0 / 9.0)
    assert out["agentrl_train_rewards"] == [0.1, 0.2, 0.3]


def test_agentrl_side_has_the_matched_settings_not_the_quickstart_preset(tmp_path, tiny_model_dir):
    from agentrl.data.io import write_rows
    from agentrl_benchmarks.trainer import Settings, _rows, agentrl_config

    train_file = write_rows(_rows(0, 8), tmp_path / "train.parquet")
    cfg = agentrl_config(tiny_model_dir, train_file, tmp_path, Settings())
    assert not cfg.use_reference and not cfg.actor.use_kl_loss  # TRL's beta=0: no KL, no reference model
    assert cfg.actor.optim.lr_warmup_steps == 0 and cfg.actor.optim.lr_scheduler == "constant"
    assert cfg.actor.optim.lr == Settings().lr and cfg.actor.optim.betas == (0.9, 0.999)
    assert cfg.rollout.temperature == Settings().temperature and cfg.rollout.n == Settings().n
    assert not cfg.trainer.save_rollouts  # TRL keeps no rollouts: the same work on both sides



def test_the_calculator_race_gives_both_sides_the_same_tool_turns_and_reward(tmp_path):
    """The multi-turn race (--task calculator): agentrl's tool loop and TRL's see one tool schema
    (so one system prompt), one turn limit, one response budget and one reward."""
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema

    from agentrl.data.io import write_rows
    from agentrl.tiny import shipped_skilled_model
    from agentrl_benchmarks import trainer_calculator as calculator
    from agentrl_benchmarks.trainer import TASK_DEFAULTS, Settings, agentrl_config
    from agentrl_tools.calculator import CalculatorTool

    settings = Settings(**{"task": "calculator", **TASK_DEFAULTS["calculator"], "steps": 2, "prompts": 2})
    base = shipped_skilled_model("calculator")
    cfg = agentrl_config(base, write_rows(calculator.train_rows(settings), tmp_path / "train.parquet"), tmp_path, settings)
    assert (cfg.agent.max_assistant_turns, cfg.rollout.max_new_tokens, cfg.data.max_response_length) == (4, 96, 96)
    assert cfg.reward.default == "gsm8k" and not cfg.use_reference

    tokenizer = AutoTokenizer.from_pretrained(base)
    rows, reward, parts = calculator.trl_parts(tokenizer, settings)
    assert parts["config"] == {"max_tool_calling_iterations": calculator.TOOL_ROUNDS}  # 3 calls, then the 4th turn answers
    [tool] = parts["tools"]
    assert get_json_schema(tool) == CalculatorTool.schema()
    assert tool(expression="48 / 2") == "24" and tool(expression="1/3") == "0.333333"  # the plugin's arithmetic and format
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in calculator.train_rows(settings)]
    truth = rows[0]["ground_truth"]
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {}}}]}
    answered = [call, {"role": "tool", "content": truth}, {"role": "assistant", "content": f"#### {truth}"}]
    assert reward([answered, answered[:2], [{"role": "assistant", "content": f"The answer is {truth}."}]], [truth] * 3) == [1.0, 0.0, 0.0]


def test_the_calculator_race_starts_from_the_calculator_base_only():
    from agentrl_benchmarks.trainer import main

    with pytest.raises(SystemExit) as exited:
        main(["--task", "calculator", "--model-size", "18m", "--skip-trl"])
    assert exited.value.code == 2


def test_rl_seed_changes_only_the_trainers_seed(tmp_path, tiny_model_dir):
    """--rl-seed: the spread of one warm start over the trainers' own randomness; the warm start,
    the prompts and the evaluation keep --seed."""
    from agentrl.data.io import write_rows
    from agentrl_benchmarks.trainer import Settings, _rows, agentrl_config

    train_file = write_rows(_rows(0, 8), tmp_path / "train.parquet")
    assert agentrl_config(tiny_model_dir, train_file, tmp_path, Settings(seed=2)).trainer.seed == 2
    settings = Settings(seed=2, rl_seed=5)
    assert agentrl_config(tiny_model_dir, train_file, tmp_path, settings).trainer.seed == 5
    assert settings.seed == 2  # what the warm start, train_rows and evaluate read


def test_first_turn_probe_renders_the_prompt_as_trl_does_and_counts_the_exact_rate():
    """agentrl_benchmarks.first_turn: the race's prompts rendered once (agentrl's rendering, checked
    equal to TRL's), and each sampler's rate set against the exact one in standard errors."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    from agentrl.tiny import shipped_skilled_model
    from agentrl_benchmarks import first_turn
    from agentrl_benchmarks.trainer_calculator import train_rows

    tokenizer = AutoTokenizer.from_pretrained(shipped_skilled_model("calculator"))
    rows = train_rows(type("S", (), {"seed": 0, "prompts": 3, "steps": 1})())
    prompts = first_turn._rendered_prompts(tokenizer, rows)
    assert len(prompts) == 3 and all(tokenizer.decode(p).endswith("<|im_start|>assistant\n") for p in prompts)
    assert first_turn._rate(60, 100, 0.5) == {"rate": 0.6, "n": 100, "se": 0.049, "z_vs_exact": 2.0}


def test_agentrl_goes_passive_on_a_busy_machine_only_and_never_over_the_users_choice():
    """What `agentrl train` (and the benchmark's agentrl side) does before torch loads (#49 item 2)."""
    from agentrl.cli import SPINNING_COMMANDS, shared_machine_wait_policy

    busy: dict[str, str] = {}
    assert shared_machine_wait_policy(busy, load=0.5) == "PASSIVE" and busy == {"OMP_WAIT_POLICY": "PASSIVE"}
    idle: dict[str, str] = {}
    assert shared_machine_wait_policy(idle, load=0.49) is None and idle == {}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}):
        environ = dict(chosen)
        assert shared_machine_wait_policy(environ, load=8.0) is None and environ == chosen
    assert SPINNING_COMMANDS == ("train", "sft", "rollout", "replay")


def test_busy_cores_sees_a_busy_loop_beside_it_now():
    """What the policy reads when no figure is given: cores busy over a 0.1 s look, not the load
    average (which kept counting a job that had ended, so a command started just after it on an
    idle machine went passive: the trainer benchmark's agentrl side after each TRL side)."""
    import subprocess
    import sys
    import time

    from agentrl.cli import busy_cores

    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the loop is running
        assert busy_cores(0.2) >= 0.8  # one core's worth (more if the machine has other work)
    finally:
        loop.kill()
        loop.wait(timeout=30)
