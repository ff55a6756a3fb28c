"""Real runs on CPU (one rank per group: in the driver's process, trainer.workers=auto): the run
directory, engine/trainer logprob agreement, resume. The same through Ray: test_in_process.py."""

from __future__ import annotations

import html
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

SHORT = [
    "trainer.total_steps=3", "trainer.save_freq=1", "trainer.test_freq=2", "trainer.max_checkpoints=2",
    "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4",
    "data.task_train_size=32", "data.task_val_size=8", "rollout.max_new_tokens=32", "data.max_response_length=96",
    "sft.num_demos=32", "sft.epochs=1", "logging.progress=false", "actor.optim.lr=1e-3",
    # any number in the answer scores 0.5, the right one 1: the barely warmed-up model earns
    # rewards that differ within a group, so the policy moves and the comparisons below (resume,
    # disk sync) see the update (with verl's strict reward every reward here was 0)
    "reward.default=gsm8k_flexible", "reward.format_score=0.5",
    # the untrained tiny model, not the quickstart's calculator-skilled base: that one answers
    # every question right after RL's first steps, and equal rewards would leave the policy in place
    "model.tiny.skills=none", "rollout.temperature=0.7",
]
TIMING = ("timing/", "tokens/per_s")


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # the environment of a user's shell: no RAY_AUTH_MODE (agentrl starts its local Ray without auth itself)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "train", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out: dict[int, dict] = {}
    for row in rows:
        if "reward/mean" in row:  # training steps (validation rows have only val/ keys)
            out[row["step"]] = row
    return out


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    done = run_cli(SHORT + [f"trainer.runs_root={root}", "trainer.run_name=short"], cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == f"run directory: {root / 'short'}"
    return root / "short"


def test_shortened_quickstart_writes_the_run_directory(short_run):
    summary = json.loads((short_run / "summary.json").read_text())
    assert {"heldout_success_before", "heldout_success_after", "algorithm", "wall_s", "steps"} <= set(summary)
    assert summary["algorithm"] == "grpo" and summary["steps"] == 3
    assert sorted(metrics_by_step(short_run)) == [1, 2, 3]
    assert (short_run / "config.yaml").read_text().count("adv_estimator: grpo") == 1
    assert sorted(p.name for p in (short_run / "checkpoints").iterdir()) == ["step_2", "step_3"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(short_run / "policy")
    AutoTokenizer.from_pretrained(short_run / "policy")
    report = (short_run / "report.html").read_text()
    assert "<svg" in report and "success rate" in report and "Sample trajectories" in report
    # the headline first (held-out success and tool use, the command, its wall time), the raw summary after the plots
    command = shlex.join(["agentrl", "train", *SHORT, f"trainer.runs_root={short_run.parent}", "trainer.run_name=short"])
    assert summary["command"] == command
    headline = report[report.index('<section class="result">'):report.index("<h2>Over steps</h2>")]
    assert "held-out success</th>" in headline and "held-out tool use</th>" in headline
    assert f"<code>{html.escape(command)}</code> · wall time " in headline
    assert report.index("<h2>Over steps</h2>") < report.index("<h2>Run summary (summary.json)</h2>") < report.index("<h2>Sample trajectories</h2>")
    assert '<div class="turn sampled"><div class="role">assistant · tokens [0, ' in report  # the replay report's renderer


def test_the_run_reports_where_its_start_up_went(short_run):
    """Each phase before step 1, in metrics.jsonl (step 0), the summary and the report."""
    summary = json.loads((short_run / "summary.json").read_text())
    startup = {k: v for k, v in summary.items() if k.startswith("startup/")}
    phases = ("imports_and_config", "model", "data", "tokenizer", "actor_workers", "sft", "reference_workers",
              "validation_before")  # no Ray: one rank per group runs in the driver
    assert list(startup) == [f"startup/{p}_s" for p in phases] + ["startup/total_s"]  # in the order they ran
    assert all(startup[f"startup/{p}_s"] > 0 for p in ("imports_and_config", "actor_workers", "sft"))
    assert startup["startup/total_s"] == pytest.approx(sum(v for k, v in startup.items() if k != "startup/total_s"), abs=0.01)
    # after the process started, train() timed the rest: its wall time holds every phase but the first
    assert startup["startup/total_s"] - startup["startup/imports_and_config_s"] < summary["wall_s"]
    rows = [json.loads(line) for line in (short_run / "metrics.jsonl").read_text().splitlines()]
    [logged] = [r for r in rows if "startup/total_s" in r]
    assert logged["step"] == 0 and {k: v for k, v in logged.items() if k != "step"} == startup
    # the report's start-up table: each phase by name, in seconds
    assert f'<th scope="row">actor workers</th><td>{startup["startup/actor_workers_s"]:.1f} s</td>' in (short_run / "report.html").read_text()


def test_the_runs_rollout_store_holds_every_step_with_its_rows(short_run):
    from agentrl.data.rollout_store import RolloutStore, TrajectoryFilter

    store = RolloutStore(short_run / "rollouts")
    assert store.steps("train") == [1, 2, 3]  # as the console and metrics.jsonl number them
    assert store.steps("val") == [0, 2, 3]  # before training, at test_freq, after the last step
    train = list(store.iter_stored(TrajectoryFilter(split="train")))
    assert len(train) == 3 * 4 * 2  # steps x prompts x n
    assert all(s.row is not None and s.trajectory.policy_version == s.step - 1 for s in train)
    assert {s.trajectory.group_id.split("/")[0] for s in train} == {"train0", "train1", "train2"}
    shown = subprocess.run([sys.executable, "-m", "agentrl.cli", "replay", "show", str(short_run), "--split", "val", "--limit", "1"],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "tool_call" in shown.stdout or "assistant" in shown.stdout


def test_every_step_reports_the_metrics_that_matter(short_run):
    for row in metrics_by_step(short_run).values():
        for key in ("reward/mean", "reward/std", "success_rate", "turns/mean", "tool_calls/mean", "entropy/mean",
                    "actor/pg_loss", "actor/clipfrac", "actor/grad_norm", "logprob_mismatch/mean", "logprob_mismatch/max",
                    "tokens/per_s", "timing/rollout_s", "timing/old_logprobs_s", "timing/actor_update_s", "timing/weight_sync_s"):
            assert key in row, key


def assert_the_policy_moved(steps: dict[int, dict]) -> None:
    """Rewards differ within groups, the gradient is not zero, and the policy leaves the reference."""
    assert all(row["reward/std"] > 0 and row["actor/grad_norm"] > 0 for row in steps.values()), steps
    # the k1 estimate of KL(policy || reference) is a sample mean of log-ratios: it can come out
    # below 0 after a small step; what must not happen is the policy staying the reference
    assert all(steps[step]["kl/policy_ref"] != 0 and steps[step]["actor/ppo_kl"] != 0 for step in steps if step > 1), steps


def test_the_short_run_trains(short_run):
    assert_the_policy_moved(metrics_by_step(short_run))


def test_engine_and_trainer_logprobs_agree_in_fp32(short_run):
    # measured on this run: mean 1.9e-7, max 9.5e-7 (float rounding of the two forwards)
    for row in metrics_by_step(short_run).values():
        assert row["logprob_mismatch/mean"] < 1e-6
        assert row["logprob_mismatch/max"] < 1e-5


def test_resume_continues_with_the_same_metrics(short_run, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(short_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_3")
    original = metrics_by_step(short_run)
    lines = [l for l in (resumed / "metrics.jsonl").read_text().splitlines() if json.loads(l)["step"] <= 2]
    (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    done = run_cli(SHORT + [f"trainer.resume={resumed}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_the_policy_moved(metrics_by_step(resumed))
    again = metrics_by_step(resumed)[3]
    expected = original[3]
    compared = [k for k in expected if not k.startswith(TIMING)]
    assert compared and all(k in again for k in compared)
    for key in compared:
        assert again[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key


def test_weight_sync_through_disk_gives_the_steps_of_the_in_memory_sync(short_run, tmp_path):
    """engine.weight_sync=disk: the engine reloads a transformers checkpoint (SGLang's path).
    The run also keeps no rollouts (trainer.save_rollouts=false), which changes nothing else."""
    changed = {"trainer.total_steps": "2", "trainer.save_freq": "0", "trainer.export_hf": "false"}
    args = [a for a in SHORT if a.split("=")[0] not in changed] + [f"{k}={v}" for k, v in changed.items()]
    done = run_cli(args + ["engine.weight_sync=disk", "trainer.save_rollouts=false", f"trainer.runs_root={tmp_path}",
                           "trainer.run_name=disk"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "disk" / "engine_weights" / "config.json").is_file()
    assert not (tmp_path / "disk" / "rollouts").exists() and (short_run / "rollouts").is_dir()
    memory, disk = metrics_by_step(short_run), metrics_by_step(tmp_path / "disk")
    assert sorted(disk) == [1, 2]
    assert_the_policy_moved(disk)
    for step in (1, 2):
        compared = [k for k in memory[step] if not k.startswith(TIMING) and not k.startswith("val/")]
        for key in compared:
            assert disk[step][key] == pytest.approx(memory[step][key], rel=1e-4, abs=1e-6), (step, key)



def test_max_staleness_0_is_todays_synchronous_trainer(short_run, tmp_path):
    """The switch off, said explicitly, changes nothing: the same metrics (no async/ keys), the
    same checkpoints byte for byte."""
    done = run_cli(SHORT + ["rollout.max_staleness=0", "rollout.stale_groups=wait", f"trainer.runs_root={tmp_path}",
                            "trainer.run_name=eta0"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    today, eta0 = metrics_by_step(short_run), metrics_by_step(tmp_path / "eta0")
    for step in (1, 2, 3):
        assert sorted(eta0[step]) == sorted(today[step])
        assert {k: v for k, v in eta0[step].items() if not k.startswith(TIMING)} == \
            {k: v for k, v in today[step].items() if not k.startswith(TIMING)}, step
    for step in ("step_2", "step_3"):
        ours, theirs = tmp_path / "eta0" / "checkpoints" / step, short_run / "checkpoints" / step
        names = sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
        assert names and names == sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
        for name in names:
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), (step, name)


def test_an_asynchronous_run_trains_within_its_staleness_bound(tmp_path):
    """rollout.max_staleness=1: batches are rolled out one step ahead while the trainer trains;
    every trained sample is at most one version old, some are exactly one, and the policy moves."""
    changed = {"trainer.save_freq": "0", "trainer.test_freq": "0", "trainer.export_hf": "false"}
    args = [a for a in SHORT if a.split("=")[0] not in changed] + [f"{k}={v}" for k, v in changed.items()]
    done = run_cli(args + ["rollout.max_staleness=1", "rollout.partial=true", "actor.rollout_correction.level=token",
                           f"trainer.runs_root={tmp_path}", "trainer.run_name=async"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = metrics_by_step(tmp_path / "async")
    assert sorted(steps) == [1, 2, 3]
    assert_the_policy_moved(steps)
    assert all(row["async/staleness_max"] <= 1 for row in steps.values()), steps
    assert steps[1]["async/staleness_max"] == 0  # step 1 trains at version 0, what it was sampled by
    assert any(row["async/staleness_max"] == 1 for row in steps.values())  # the run was asynchronous
    for row in steps.values():  # every trained trajectory counted once in the histogram: 4 groups x 2 samples
        assert row["async/staleness_hist/0"] + row["async/staleness_hist/1"] == 8
        assert "rollout_corr/weight_mean" in row
        assert 0 < row["engine/busy_fraction"] <= 1 and row["engine/resumed_requests"] <= row["engine/interrupted_requests"]
    assert "no off-policy correction" not in done.stdout + done.stderr
    from agentrl.data.rollout_store import RolloutStore

    trained = list(RolloutStore(tmp_path / "async" / "rollouts").iter_trajectories())
    for t in trained:  # every sampled token carries the version that sampled it
        assert len(t.token_versions) == len(t.response_ids)
        assert all((v >= 0) == bool(m) for v, m in zip(t.token_versions, t.response_mask)), t.group_id
    stored = sorted(p.name for p in (tmp_path / "async" / "rollouts").glob("train-*.parquet"))
    assert stored == [f"train-step00000{k}-w000.parquet" for k in (1, 2, 3)]


def test_total_epochs_ends_the_run_at_the_end_of_the_data(tmp_path):
    """8 rows in batches of 4 are 2 steps an epoch: total_epochs=1 stops there, before total_steps=5."""
    changed = {"trainer.total_steps": "5", "trainer.total_epochs": "1", "data.task_train_size": "8", "actor.ppo_mini_batch_size": "4",
               "trainer.save_freq": "0", "trainer.test_freq": "0", "trainer.export_hf": "false", "sft.enable": "false",
               "trainer.val_before_train": "false", "trainer.save_rollouts": "false"}
    args = [a for a in SHORT if a.split("=")[0] not in changed] + [f"{k}={v}" for k, v in changed.items()]
    done = run_cli(args + [f"trainer.runs_root={tmp_path}", "trainer.run_name=epochs"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(metrics_by_step(tmp_path / "epochs")) == [1, 2]
    assert json.loads((tmp_path / "epochs" / "summary.json").read_text())["steps"] == 2
