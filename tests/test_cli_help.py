"""Every command explains itself: ``--help`` answers with exit 0, and the config commands' help
and ``--cfg job`` come from the schema and the composed preset (run through the real CLI)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentrl.cli import COMMANDS, CONFIG_COMMANDS
from agentrl.config.help import command_help, config_keys, schema_docs


def agentrl(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_answers_help_with_usage_and_exit_0(command):
    out = agentrl(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower() or command in out.stdout, out.stdout[:300]


@pytest.mark.parametrize("argv", [["replay", "show", "--help"], ["data", "validate", "--help"], ["bench", "engine", "--help"]])
def test_subcommands_answer_help(argv):
    out = agentrl(*argv)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: agentrl " + " ".join(argv[:2])), out.stdout[:200]


def test_train_help_lists_groups_with_the_default_marked_and_keys_with_type_default_and_doc(tmp_path):
    out = agentrl("train", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    algorithm = next(line for line in lines if line.split()[:1] == ["algorithm"])
    assert "grpo*" in algorithm.split() and "ppo" in algorithm.split()
    batch = next(line for line in lines if line.split()[:1] == ["data.train_batch_size"])
    # type, the quickstart preset's value (not the schema's 16), and the schema comment
    assert batch.split()[1:4] == ["int", "=", "8"] and batch.endswith("prompts per step")
    turns = next(line for line in lines if line.split()[:1] == ["agent.max_assistant_turns"])
    assert turns.split()[1:4] == ["int", "=", "8"]
    assert not list(tmp_path.iterdir()), "help must not create a run directory"


def test_help_shows_the_defaults_of_the_overrides_given_on_the_same_line():
    text = command_help("train", ["algorithm=ppo", "rollout.n=3"], "summary")
    values = {line.split()[0]: line.split()[3] for line in text.splitlines() if line.startswith("  ") and " = " in line}
    assert values["algorithm.adv_estimator"] == "'gae'"
    assert values["critic.enable"] == "True"
    assert values["rollout.n"] == "3"


def test_every_schema_key_appears_in_the_help_once():
    text = command_help("train", [], "summary")
    keys = [line.split()[0] for line in text.splitlines() if line.startswith("  ") and " = " in line]
    assert sorted(keys) == sorted(key for key, *_ in config_keys())


def test_schema_docs_come_from_the_comment_beside_or_above_the_field():
    docs = schema_docs()
    assert docs["DataConfig.train_batch_size"] == "prompts per step"  # beside
    assert docs["ModelConfig.path"].startswith("A local transformers checkpoint directory")  # above
    assert "DataConfig.shuffle" not in docs  # no comment: no invented doc


def test_cfg_job_prints_the_resolved_config_and_runs_nothing(tmp_path):
    out = agentrl("train", "--cfg", "job", "actor.clip_ratio=0.28", "actor_rollout_ref.rollout.response_length=40", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "  clip_ratio: 0.28" in out.stdout.splitlines()
    assert "  max_new_tokens: 40" in out.stdout.splitlines()  # verl's name, translated
    assert not list(tmp_path.iterdir())


def test_cfg_job_reports_an_invalid_override_by_its_key():
    out = agentrl("train", "--cfg", "job", "rollout.n=many")
    assert out.returncode == 1
    assert "rollout.n" in out.stderr


def test_cfg_needs_job():
    out = agentrl("sft", "--cfg", "hydra")
    assert out.returncode == 2
    assert "--cfg takes 'job'" in out.stdout


def test_config_commands_are_commands():
    assert set(CONFIG_COMMANDS) <= set(COMMANDS)


@pytest.mark.parametrize("command", ["train", "rollout"])
def test_ctrl_c_ends_a_command_with_130_and_train_says_how_to_go_on(command, monkeypatch, capsys):
    import agentrl.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_resolve", lambda target: interrupted)
    assert cli.main([command, "trainer.total_steps=1"]) == 130
    importing, said = capsys.readouterr().err.strip().splitlines()
    assert importing == f"agentrl {command}: {cli.IMPORTING}"  # the sign of life before the imports
    if command == "train":
        assert said == ("agentrl train: interrupted (the same command with trainer.resume=auto goes on from the last "
                        "checkpoint it saved, if it saved one)")
    else:
        assert said == "agentrl rollout: interrupted"
