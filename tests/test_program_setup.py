"""An agent program whose package is missing is a setup problem, not the model's output.

With agentrl's base install the shipped programs' ``openai`` is absent; the throwaway ``myplugin``
distribution (``tests/fixtures/plugin_dist``) has a program that imports a package installed
nowhere with its module, one that imports it at its first call, and one that always raises.
The first is refused before any work by every check that names it (``data validate``, the data
check of ``train`` and ``rollout``, ``plugins list --check``), naming the program, the module
and what to install; the second ends each episode in ``loop_error`` (infrastructure, out of the
loss, and a run of them fails); a rollout whose every episode ended ``program_error`` fails too.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from agentrl.data.io import write_rows
from agentrl.data.row import Row
from agentrl.errors import DataError
from agentrl.plugins import PluginRegistry
from test_plugin_dist import dist_path, site  # noqa: F401  (fixtures: myplugin installed, other distributions hidden)

LOAD_ERROR = ("plugin 'absent_at_import' in group agentrl.agents (entry point absent_at_import = myplugin_absent:solve, "
              "distribution myplugin) failed to load: ModuleNotFoundError: No module named 'agentrl_absent_dependency' "
              "(the module 'agentrl_absent_dependency' is not installed: install the package that provides it)")


def program_row(program: str, index: int = 0) -> dict:
    return {"data_source": "x", "prompt": [{"role": "user", "content": "What is 1 + 0?"}], "agent_name": "openai_agent",
            "reward_model": {"ground_truth": "1"}, "extra_info": {"index": index, "agent_program": program}}


def test_a_program_missing_a_package_at_import_is_refused_by_every_check_before_any_work(dist_path, tmp_path, capsys):
    from agentrl.cli import main
    from agentrl.config import load_config
    from agentrl.data.prepare import prepare_data

    data = write_rows([program_row("gives_up", 0), program_row("absent_at_import", 1), program_row("absent_at_import", 2)],
                      tmp_path / "rows.parquet")
    expected = (f"file {data}, row 1, field extra_info.agent_program: agent program 'absent_at_import' cannot be loaded: "
                f"{LOAD_ERROR} (the same in row 2 of {data})")
    assert main(["data", "validate", str(data)]) == 1
    assert capsys.readouterr().out.splitlines()[0] == expected
    # train and rollout check their rows with the same call, before a model or an engine is built
    cfg = load_config("rollout", [f"data.train_files=[{data}]"], training=False)
    with pytest.raises(DataError) as refused:
        prepare_data(cfg, tmp_path / "data", evaluate=True)
    assert str(refused.value).splitlines()[1:] == [f"  {expected}"]
    assert main(["plugins", "list", "--check", "--group", "agents"]) == 1
    out, err = capsys.readouterr()
    status = {line.split()[1]: line.split()[-1] for line in out.splitlines() if line.startswith("agentrl.agents ")}
    assert status["absent_at_import"] == "BROKEN" and status["absent_at_call"] == status["gives_up"] == "ok"
    assert err.splitlines() == [LOAD_ERROR]


def test_a_shipped_program_without_its_package_names_the_extra_that_installs_it(monkeypatch):
    """The base install: ``openai`` (and the Agents SDK) absent; each program imports them with its module."""
    for module in [m for m in sys.modules if m.startswith("agentrl_agent_programs.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai raises ModuleNotFoundError, as when it is not installed
    problem = PluginRegistry().import_problem("agents", "gsm8k_calculator")
    assert problem == (
        "plugin 'gsm8k_calculator' in group agentrl.agents (entry point gsm8k_calculator = "
        "agentrl_agent_programs.gsm8k_calculator:solve, distribution agentrl) failed to load: ModuleNotFoundError: "
        "import of openai halted; None in sys.modules (the module 'openai' is not installed: pip install \"agentrl[openai]\")"
    )
    monkeypatch.setitem(sys.modules, "agents", None)  # neither: the SDK's extra, which brings both
    problem = PluginRegistry().import_problem("agents", "gsm8k_calculator_agents_sdk")
    assert problem is not None and problem.endswith("(the module 'agents' is not installed: pip install \"agentrl[agents]\")")
    monkeypatch.delitem(sys.modules, "openai")  # openai installed, the Agents SDK not
    monkeypatch.setitem(sys.modules, "agents", None)
    problem = PluginRegistry().import_problem("agents", "gsm8k_calculator_agents_sdk")
    assert problem is not None and problem.endswith("import of agents halted; None in sys.modules "
                                                    "(the module 'agents' is not installed: pip install \"agentrl[agents]\")")


def run_programs(tokenizer, rows: list[tuple[str, Row]]):
    from agentrl.agent.runner import LoopTable, RolloutRunner, build_context
    from agentrl.agent.scripted import ScriptedEngine
    from agentrl.agent.setup import RolloutSetup
    from agentrl.config.schema import DataConfig, TrainConfig

    engine = ScriptedEngine(tokenizer, {row_id: ["#### 1"] for row_id, _ in rows})
    ctx = build_context(engine, tokenizer, RolloutSetup.from_config(TrainConfig(data=DataConfig(max_response_length=64))),
                        tool_names=[])
    return asyncio.run(RolloutRunner(ctx, LoopTable("tool_agent")).run(rows))


def test_a_program_importing_a_missing_package_at_its_first_call_fails_the_run_as_a_setup_problem(dist_path, tiny_tokenizer):
    from agentrl.agent.outcomes import summarize_finishes
    from agentrl.trainer.step import RolloutFailed, failure_metrics

    rows = [(f"r{i}", Row.model_validate(program_row("absent_at_call", i))) for i in range(2)]
    trajectories = run_programs(tiny_tokenizer, rows)
    assert [t.finish_reason for t in trajectories] == ["loop_error", "loop_error"]  # infrastructure: out of the loss
    assert trajectories[0].reward_info["error"] == (
        "setup: the agent program 'absent_at_call' raised ModuleNotFoundError: No module named 'agentrl_absent_dependency' "
        "(the module 'agentrl_absent_dependency' is not installed: install the package that provides it); a missing "
        "package is the installation's problem, not the model's output")
    assert summarize_finishes(trajectories).verdict(0.5) == "2 of 2 trajectories failed, more than rollout.max_failure_rate = 0.5"
    with pytest.raises(RolloutFailed, match="2 of 2 trajectories failed"):
        failure_metrics(trajectories, max_rate=0.5)


def test_a_rollout_whose_every_episode_ended_program_error_fails(dist_path, tiny_tokenizer):
    from agentrl.agent.outcomes import summarize_finishes

    rows = [(f"r{i}", Row.model_validate(program_row("gives_up", i))) for i in range(2)]
    failed = summarize_finishes(run_programs(tiny_tokenizer, rows))
    assert (failed.counts, failed.failed_fraction) == ({"program_error": 2}, 0.0)  # scored episodes, not infrastructure
    assert failed.verdict(0.5) == ("every one of the 2 trajectories ended program_error: the agent program raised "
                                   "whatever the model wrote (its first error is above)")
    assert failed.lines()[1] == "first program_error (2 in all): row r0 sample 0: ValueError: this program gives up whatever the model writes"
    # one episode that ends of its own: the program failed on what the model wrote, not on everything
    mixed = summarize_finishes(run_programs(tiny_tokenizer, [*rows, ("r9", Row.model_validate(program_row("gsm8k_calculator", 9)))]))
    assert (mixed.counts, mixed.verdict(0.5)) == ({"program_error": 2, "stop": 1}, None)


def test_agentrl_rollout_where_every_episode_ended_program_error_exits_1(dist_path, tiny_model_dir, tmp_path, capsys):
    """The issue's run: 16 episodes, each the program's error; the command said failed_fraction 0.0 and exited 0."""
    import json

    from agentrl.agent.rollout_cli import cli_main

    rows = write_rows([program_row("gives_up", i) for i in range(2)], tmp_path / "rows.parquet")
    script = tmp_path / "script.jsonl"
    script.write_text("".join(json.dumps({"row": f"x:{i}", "answers": ["#### 1"]}) + "\n" for i in range(2)))
    assert cli_main(["engine=scripted", f"engine.script={script}", f"model.path={tiny_model_dir}", f"data.train_files=[{rows}]",
                     "rollout.n=2", f"trainer.runs_root={tmp_path}", "trainer.run_name=r", "logging.progress=false"]) == 1
    out, err = capsys.readouterr()
    summary = json.loads(out[: out.rindex("}") + 1])
    assert (summary["finish_reasons"], summary["failed_fraction"], summary["program_error_fraction"]) == ({"program_error": 4}, 0.0, 1.0)
    assert err.splitlines()[-1] == ("agentrl rollout: every one of the 4 trajectories ended program_error: the agent program "
                                    "raised whatever the model wrote (its first error is above)")
