"""``agentrl train`` says what it is doing before its first step (imports, config, model, data,
workers, SFT, RL), one line on stderr each: a fresh install's first run waits minutes there."""

from __future__ import annotations

from agentrl.config import load_config
from agentrl.trainer.progress import model_line, rl_line, workers_line


def test_the_lines_name_the_model_the_workers_and_the_rl_steps():
    quickstart = load_config("train", [], check_files=False)
    assert model_line(quickstart) == "model: the tiny model (1m parameters, seed 0, with the calculator skills agentrl ships)"
    assert model_line(load_config("train", ["model.tiny.seed=7"], check_files=False)) == (
        "model: building the tiny model (1m parameters, seed 7) and teaching it the calculator skills (once on this machine: minutes)")
    assert model_line(load_config("train", ["model.tiny.skills=none"], check_files=False)) == (
        "model: building the tiny model (1m parameters, seed 0)")
    assert model_line(load_config("train", ["model.path=/models/m"], check_files=False)) == "model: /models/m"
    assert workers_line(quickstart, in_process=True) == "loading the policy: actor, reference in this process"
    ppo = load_config("train", ["algorithm=ppo"], check_files=False)
    assert workers_line(ppo, in_process=False) == "loading the policy: actor, reference, critic as Ray workers"
    steps, batch, n = quickstart.trainer.total_steps, quickstart.data.train_batch_size, quickstart.rollout.n
    assert rl_line(quickstart, start_step=0) == f"RL: {steps} steps of {batch} rows x {n} samples, grpo"
    assert rl_line(quickstart, start_step=3) == f"RL: {steps - 3} steps of {batch} rows x {n} samples, grpo (resumed after step 3)"


def test_train_prints_each_phase_as_it_starts(tiny_model_dir, tmp_path, capsys):
    """Through the command, to the data check (a bad row stops it there, before any worker)."""
    from agentrl.cli import IMPORTING, main
    from agentrl.data.io import write_rows

    rows = write_rows([{"data_source": "x", "prompt": [{"role": "robot", "content": "hi"}]}], tmp_path / "rows.parquet")
    assert main(["train", f"model.path={tiny_model_dir}", f"data.train_files=[{rows}]", f"trainer.runs_root={tmp_path}",
                 "logging.progress=false"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[:4] == [f"agentrl train: {IMPORTING}", "agentrl train: reading the config", f"agentrl train: model: {tiny_model_dir}",
                         "agentrl train: data: preparing and checking the rows"]
    assert lines[4].startswith("agentrl train: invalid data (1 problem")
