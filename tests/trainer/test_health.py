"""The run's health measures and their bounds (trainer/health.py), on hand-made trajectories."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import load_config
from agentrl.config.schema import HealthConfig
from agentrl.trainer.batch import collate
from agentrl.trainer.health import HealthMonitor, HealthStop, served_policy_mismatch, tool_error_rates, uniform_group_share
from agentrl.trajectory import NO_VERSION, ToolCallRecord, Trajectory, Turn


def _traj(group: str, reward: float, *, logprobs=(-1.0, -1.0, -1.0), versions=(), calls=()) -> Trajectory:
    return Trajectory(row_id=group, group_id=group, sample_index=0, data_source="t", agent_name="single_turn", prompt_ids=[5, 6], response_ids=[7, 8, 9], response_mask=[1, 0, 1],
                      logprobs=list(logprobs), turns=[Turn("assistant", 0, 1), Turn("tool", 1, 2), Turn("assistant", 2, 3)], messages=[], finish_reason="stop", reward=reward,
                      token_versions=list(versions), tool_calls=list(calls))


def test_the_mismatch_counts_only_the_tokens_sampled_at_the_trainers_version():
    # row 0's two sampled tokens: version 3 (off by 0.5) and 2 (off by 2.0, an older policy's); row 1's: unknown
    trajectories = [_traj("a", 1.0, logprobs=(-1.5, 0.0, -3.0), versions=(3, NO_VERSION, 2)),
                    _traj("b", 0.0, logprobs=(-1.0, 0.0, -1.0))]
    batch = collate(trajectories, pad_token_id=0, max_prompt_length=4, max_response_length=4)
    batch = batch.replace(old_logprobs=torch.full_like(batch.engine_logprobs, -1.0))
    assert served_policy_mismatch(trajectories, batch, 3) == (0.5, 1)
    assert served_policy_mismatch(trajectories, batch, 2) == (2.0, 1)
    assert served_policy_mismatch(trajectories, batch, 4) == (0.0, 0)


def test_uniform_groups_are_those_whose_samples_all_got_one_reward():
    trajectories = [_traj("a", 1.0), _traj("a", 1.0), _traj("b", 0.0), _traj("b", 1.0), _traj("c", 0.0), _traj("c", 0.0)]
    assert uniform_group_share(trajectories) == pytest.approx(2 / 3)
    assert uniform_group_share([_traj("a", 1.0), _traj("b", 0.0)]) is None  # rollout.n=1: nothing to compare


def test_tool_error_rates_are_shares_of_all_calls_by_kind():
    ok, boom, late = (ToolCallRecord(turn=0, name="calc", arguments={}, raw="", result="", error=e) for e in (None, "tool_exception", "timeout"))
    assert tool_error_rates([_traj("a", 0.0, calls=[ok, boom, boom]), _traj("a", 0.0, calls=[late])]) == {
        "tool_exception": 0.5, "timeout": 0.25}


def test_a_measure_warns_once_per_streak_and_stops_after_its_stop_steps():
    said: list[str] = []
    config = load_config("train", ["trainer.health.tool_errors.warn_steps=2", "trainer.health.tool_errors.stop_steps=3"],
                         check_files=False).trainer.health
    assert config.tool_errors.warn == 0.5 and config.tool_errors.stop == 1.0  # one key set keeps the measure's other defaults
    monitor = HealthMonitor(config, say=said.append)
    failing = {"health/tool_error_rate/tool_exception": 1.0}
    monitor.check(1, failing)
    assert said == []
    monitor.check(2, failing)
    assert len(said) == 1 and said[0].startswith(
        "warning: step 2: tool_errors/tool_exception = 1, at or above trainer.health.tool_errors.warn=0.5 on 2 consecutive "
        "steps: tool calls fail when they run.")
    with pytest.raises(HealthStop, match=r"^step 3: tool_errors/tool_exception = 1, at or above "
                                         r"trainer.health.tool_errors.stop=1.0 on 3 consecutive steps") as stop:
        monitor.check(3, failing)
    assert stop.value.record()["key"] == "trainer.health.tool_errors.stop" and len(said) == 1


def test_a_streak_broken_by_a_healthy_step_starts_again():
    monitor = HealthMonitor(HealthConfig(), say=lambda _: None)
    mismatch = {"health/logprob_mismatch": 0.05, "health/mismatch_tokens": 10.0}
    for step in range(1, 6):  # over the bound every other step: never two in a row
        monitor.check(step, mismatch if step % 2 else {"health/logprob_mismatch": 1e-7, "health/mismatch_tokens": 10.0})
    with pytest.raises(HealthStop, match="on 2 consecutive steps"):
        monitor.check(6, mismatch)
    # a step without a token of the trainer's version is not measured (it neither breaks nor extends a streak)
    quiet = HealthMonitor(HealthConfig(), say=lambda _: None)
    quiet.check(1, mismatch)
    quiet.check(2, {"health/logprob_mismatch": 0.0, "health/mismatch_tokens": 0.0})
    with pytest.raises(HealthStop):
        quiet.check(3, mismatch)


def test_an_engine_that_reports_another_version_than_the_synced_one_stops_at_once():
    monitor = HealthMonitor(HealthConfig(), say=lambda _: None, weight_sync="disk")
    monitor.check(4, {"health/synced_version": 4.0, "health/engine_version": 4.0})
    with pytest.raises(HealthStop, match=r"^step 5: after the weight sync to version 5 the engine reports weight version 4: "
                                         r".*\(engine.weight_sync=disk\)"):
        monitor.check(5, {"health/synced_version": 5.0, "health/engine_version": 4.0})


def test_agentrl_train_exits_1_with_the_reason_when_a_health_check_stopped_the_run(tmp_path, monkeypatch, capsys):
    from agentrl.trainer import run

    stopped = {"step": 3, "measure": "uniform_groups", "value": 1.0, "key": "trainer.health.uniform_groups.stop",
               "reason": "step 3: uniform_groups = 1, at or above trainer.health.uniform_groups.stop=1.0"}
    monkeypatch.setattr(run, "train", lambda cfg, command: run.RunResult(tmp_path, {"stopped": stopped}))
    assert run.cli_main(["trainer.total_steps=3"]) == 1
    assert capsys.readouterr().err.endswith(f"agentrl train: stopped after 3 steps: {stopped['reason']}\n")
    monkeypatch.setattr(run, "train", lambda cfg, command: run.RunResult(tmp_path, {}))
    assert run.cli_main(["trainer.total_steps=3"]) == 0


def test_the_report_opens_with_the_stop_and_plots_the_health_measures():
    from agentrl.report import render_report

    rows = [{"step": s, "health/uniform_groups": 0.25 * s, "health/tool_error_rate/timeout": 0.5} for s in (1, 2)]
    stopped = {"step": 2, "key": "trainer.health.uniform_groups.stop", "reason": "step 2: uniform_groups = 0.5 <x>"}
    page = render_report(rows, [], "run", summary={"stopped": stopped})
    assert ('<h2>Stopped after 2 steps by trainer.health.uniform_groups.stop</h2>'
            '<p>step 2: uniform_groups = 0.5 &lt;x&gt;</p>') in page
    assert page.index("Stopped after 2 steps") < page.index("Over steps")  # first, above the plots
    assert "run health (shares per step)" in page and "health/tool_error_rate/timeout" in page
    assert "Stopped after" not in render_report(rows, [], "run", summary={"steps": 2})
    # a stop with no setting to name (weights a sync should have replaced): why, without "by"
    no_key = render_report(rows, [], "run", summary={"stopped": {"step": 0, "key": None, "reason": "stale"}})
    assert "<h2>Stopped after 0 steps</h2><p>stale</p>" in no_key


def test_the_malformed_call_warning_names_the_parser_and_shows_a_malformed_call():
    from agentrl.trainer.health import malformed_example

    bad = ToolCallRecord(turn=0, name=None, arguments=None, raw='<tool_call>{"name": calc}</tool_call>', result="", error="bad_json")
    fine = ToolCallRecord(turn=0, name="calc", arguments={}, raw="<tool_call>{}</tool_call>", result="1", error=None)
    said: list[str] = []
    monitor = HealthMonitor(HealthConfig(), say=said.append, parser="auto (hermes)")
    monitor.example = malformed_example([_traj("a", 0.0, calls=[fine]), _traj("b", 0.0, calls=[fine, bad])])
    for step in (1, 2, 3):  # the default: warn at 0.5 on 3 steps
        monitor.check(step, {"tool_calls/malformed_rate": 0.75, "tool_calls/unparsed_turn_rate": 0.0})
    assert said == [
        "warning: step 3: malformed_calls (tool parser auto (hermes); a malformed call: '<tool_call>{\"name\": calc}</tool_call>') "
        "= 0.75, at or above trainer.health.malformed_calls.warn=0.5 on 3 consecutive steps: the policy's tool calls do not "
        "parse. Likely causes: agent.tool_parser does not match the model's call format (the chat template's), a base model "
        "never taught to call tools (start from SFT), data.max_response_length or rollout.max_new_tokens cutting calls short"]
    quiet: list[str] = []  # turns with the parser's call marker and no call read warn under the same bound
    unparsed = HealthMonitor(HealthConfig(), say=quiet.append, parser="qwen3_coder")
    for step in (1, 2, 3):
        unparsed.check(step, {"tool_calls/unparsed_turn_rate": 0.6})
    assert len(quiet) == 1 and quiet[0].startswith("warning: step 3: unparsed_turns (tool parser qwen3_coder) = 0.6")


def test_uniform_groups_are_measured_only_for_estimators_that_learn_nothing_from_them():
    from agentrl.trainer.health import step_health_metrics

    trajectories = [_traj("a", 1.0), _traj("a", 1.0)]
    batch = collate(trajectories, pad_token_id=0, max_prompt_length=4, max_response_length=4)
    batch = batch.replace(old_logprobs=batch.engine_logprobs)
    for estimator in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"):
        assert step_health_metrics(trajectories, batch, 0, estimator=estimator)["health/uniform_groups"] == 1.0
    for estimator in ("gae", "reinforce_plus_plus"):  # a critic, or the batch's whitening, still tells these apart
        assert "health/uniform_groups" not in step_health_metrics(trajectories, batch, 0, estimator=estimator)
