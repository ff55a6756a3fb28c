"""`agentrl rollout` stores exact trajectories, with their rows, in a rollout store."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agent_helpers import CALL_12x34, make_row

from agentrl.data.rollout_store import RolloutStore


def test_trajectories_round_trip_exactly_through_the_store(run_rows, tmp_path):
    row = make_row(interaction_kwargs={"name": "gsm8k", "ground_truth": "408"})
    trajectories, *_ = run_rows({"r0": [CALL_12x34, "#### 400", "#### 408"]}, [("r0", row)], n=2)
    store = RolloutStore(tmp_path)
    store.write_step(3, trajectories, rows=[("r0", row)])
    stored = list(store.iter_stored())
    assert [s.trajectory for s in stored] == trajectories
    assert [(s.step, s.split, s.row) for s in stored] == [(3, "train", row)] * 2


def test_rollout_command_writes_the_rollouts(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", "data.task_train_size=6", "rollout.n=2", "rollout.max_new_tokens=8",
         "data.train_batch_size=4",  # below the actor's mini-batch: a rollout trains nothing, so it is not refused
         f"trainer.runs_root={tmp_path}", "trainer.run_name=r", "logging.progress=false"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == f"rollouts: {tmp_path / 'r' / 'rollouts' / 'train-step000000-w000.parquet'}"
    stored = list(RolloutStore(tmp_path / "r" / "rollouts").iter_stored())
    assert len(stored) == 12 and {s.trajectory.sample_index for s in stored} == {0, 1}
    assert all(len(t.response_ids) == len(t.response_mask) == len(t.logprobs) > 0 for t in (s.trajectory for s in stored))
    assert all(s.row is not None and s.row.agent_name == "tool_agent" for s in stored)  # re-runnable without the dataset
    shown = subprocess.run([sys.executable, "-m", "agentrl.cli", "replay", "show", str(tmp_path / "r"), "--limit", "1"],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "no tokenizer" not in shown.stdout  # config.yaml names the model
    assert "<|im_start|>" in shown.stdout or "assistant" in shown.stdout


BOOM_MODULE = '''
class BoomTool:
    """verl's tool interface; its create fails as a missing sandbox would."""
    def __init__(self, config, tool_schema):
        pass
    async def create(self, instance_id=None, **kwargs):
        raise RuntimeError("no sandbox here: " + "x" * 300)
    async def execute(self, instance_id, parameters, **kwargs):
        return "", 0.0, {}
    async def release(self, instance_id, **kwargs):
        pass
'''


def test_rollout_where_every_trajectory_fails_exits_1_with_the_first_error_in_full_and_keeps_the_store(tmp_path):
    from agentrl.data.io import write_rows

    (tmp_path / "boom_tools.py").write_text(BOOM_MODULE)
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: boom_tools.BoomTool\n    tool_schema: {type: function, function: {name: boom}}\n"
    )
    rows = [make_row(f"What is {i} + 1?", str(i + 1)).model_dump(exclude_none=True) for i in range(3)]
    for r in rows:
        r["extra_info"]["tools_kwargs"] = {"boom": {"create_kwargs": {}}}
    write_rows(rows, tmp_path / "rows.parquet")
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "rollout", f"data.train_files={tmp_path / 'rows.parquet'}", "rollout.n=1",
         f"agent.tool_config_path={tmp_path / 'tools.yaml'}", f"trainer.runs_root={tmp_path}", "trainer.run_name=r",
         "logging.progress=false"],
        capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 1, (done.stdout[-1000:], done.stderr[-2000:])
    assert "3 trajectories: loop_error 3" in done.stderr
    first = next(line for line in done.stderr.splitlines() if line.startswith("first loop_error (3 in all): "))
    assert first.endswith("RuntimeError: no sandbox here: " + "x" * 300)  # whole, not cut
    assert "3 of 3 trajectories failed, more than rollout.max_failure_rate = 0.5" in done.stderr
    assert len(list(RolloutStore(tmp_path / "r" / "rollouts").iter_stored())) == 3  # nothing lost


@pytest.mark.parametrize("command", ["rollout", "train"])
def test_rollout_and_train_stop_at_startup_when_the_chat_template_cannot_show_tool_results(tmp_path, tiny_model_dir, command):
    """The check-template check runs before any engine or worker is built (here: gemma2's real
    template on the tiny tokenizer, which lacks gemma's end-of-turn token)."""
    import shutil

    from family_fixtures import family_template
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = family_template("gemma2")
    tok.save_pretrained(model)
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", command, f"model.path={model}", "agent=tool_agent", "data.task_train_size=8",
         f"trainer.runs_root={tmp_path}", "trainer.run_name=r", "logging.progress=false"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "model.path: the chat template check failed (agentrl check-template" in done.stderr
    assert "which does not start with an added token: generation needs an end-of-turn token to stop at" in done.stderr
    assert not (tmp_path / "r" / "rollouts").exists()  # stopped before generating anything
    assert not (tmp_path / "r" / "sft_policy").exists() and "start-up" not in done.stderr  # before SFT, Ray and the workers
