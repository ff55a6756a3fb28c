"""A run that cannot learn says so at the step it starts (``trainer.health``, trainer/health.py):
an always-failing tool warns at step 1 and stops the run, every sample of every group rewarded
alike warns at step 2 and stops it; each message names the measure, its key and the likely
causes, and the stop is in ``summary.json`` with a checkpoint. Tiny model, 2-3 steps, in this process."""

from __future__ import annotations

import pytest

from test_broken_weight_sync import _assert_stopped, _train


def test_an_always_failing_tool_warns_at_the_first_step_and_stops_the_run(tmp_path, monkeypatch, capsys):
    from agentrl_tools.calculator import CalculatorTool

    async def broken(self, instance_id, arguments, **kwargs):
        raise RuntimeError("the calculator's backend is down")

    monkeypatch.setattr(CalculatorTool, "execute", broken)
    # the calculator-skilled base calls the tool on most questions; the strict reward is 0 for all of them
    result, steps = _train(tmp_path, "trainer.total_steps=3", "model.tiny.skills=calculator", "reward.default=gsm8k",
                           "trainer.health.tool_errors.stop_steps=2")
    assert steps[1]["health/tool_error_rate/tool_exception"] == 1.0
    err = capsys.readouterr().err
    assert ("warning: step 1: tool_errors/tool_exception = 1, at or above trainer.health.tool_errors.warn=0.5: "
            "tool calls fail when they run.") in err
    stopped = _assert_stopped(result, 2)
    assert stopped["reason"].startswith("step 2: tool_errors/tool_exception = 1, at or above "
                                        "trainer.health.tool_errors.stop=1.0 on 2 consecutive steps")


def test_rewards_all_alike_warn_at_the_second_step_and_stop_the_run(tmp_path, capsys):
    # the untrained tiny model never writes a right answer: the strict reward is 0 for every sample
    result, steps = _train(tmp_path, "trainer.total_steps=4", "reward.default=gsm8k", "reward.format_score=0.0",
                           "trainer.health.uniform_groups.stop_steps=3")
    assert [steps[s]["health/uniform_groups"] for s in sorted(steps)] == [1.0, 1.0, 1.0]
    assert ("warning: step 2: uniform_groups = 1, at or above trainer.health.uniform_groups.warn=0.9 on 2 consecutive "
            "steps: every sample of these groups got the same reward") in capsys.readouterr().err
    stopped = _assert_stopped(result, 3)
    assert stopped["key"] == "trainer.health.uniform_groups.stop" and "reward.default" in stopped["reason"]


@pytest.mark.parametrize("key", ["logprob_mismatch", "uniform_groups", "tool_errors", "malformed_calls", "failures",
                                 "stale_groups"])
def test_a_bound_set_to_null_never_warns(key):
    from agentrl.config import load_config
    from agentrl.trainer.health import HealthMonitor

    said: list[str] = []
    health = load_config("train", [f"trainer.health.{key}.warn=null", f"trainer.health.{key}.stop=null"],
                         check_files=False).trainer.health
    monitor = HealthMonitor(health, say=said.append)
    worst = {"health/logprob_mismatch": 9.0, "health/mismatch_tokens": 1.0, "health/uniform_groups": 1.0,
             "health/tool_error_rate/tool_exception": 1.0, "health/tool_error_rate/timeout": 1.0,
             "tool_calls/malformed_rate": 1.0, "failures/rate": 1.0, "health/stale_groups": 1.0}
    measure = {"tool_errors": "tool_errors/", "failures": "failures ="}.get(key, key)
    for step in range(1, 4):
        try:
            monitor.check(step, worst)
        except Exception as stop:  # another measure's stop
            assert not str(stop).split(": ", 1)[1].startswith(measure)
    assert not any(line.split(": ", 2)[2].startswith(measure) for line in said)
