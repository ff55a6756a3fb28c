"""MetricsLogger: every key reaches metrics.jsonl; the console line adds each tool's call count."""

from __future__ import annotations

import json

from agentrl.config.schema import LoggingConfig
from agentrl.trainer.logging import MetricsLogger


def test_tool_metrics_reach_metrics_jsonl_and_call_counts_the_console(tmp_path, capsys):
    log = MetricsLogger(tmp_path, LoggingConfig(loggers=["console"]))
    log.log(3, {"reward/mean": 0.5, "tool/python/calls": 4.0, "tool/python/exit_code": 0.25, "tool/search/calls": 1.0})
    log.close()
    [record] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record == {"step": 3, "reward/mean": 0.5, "tool/python/calls": 4.0, "tool/python/exit_code": 0.25, "tool/search/calls": 1.0}
    assert capsys.readouterr().err == "[step 3] reward/mean=0.5  tool/python/calls=4  tool/search/calls=1\n"


def test_a_record_without_console_keys_goes_to_metrics_jsonl_only(tmp_path, capsys):
    log = MetricsLogger(tmp_path, LoggingConfig(loggers=["console"]))
    log.log(0, {"startup/ray_s": 2.5, "startup/total_s": 9.0})
    log.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 0, "startup/ray_s": 2.5, "startup/total_s": 9.0}]
    assert capsys.readouterr().err == ""  # no empty "[step 0]" line


def test_workers_and_commands_keep_transformers_progress_bars_off_unless_the_environment_asks(monkeypatch, tmp_path):
    import subprocess
    import sys

    from agentrl.trainer.cluster import worker_env

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    assert worker_env(threads=1)["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    assert worker_env(threads=1)["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"
    # every command sets it for its own process (driver-side model and tokenizer loads)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS")
    code = ("import sys, os; from agentrl.cli import main; main(['data', '--help']); "
            "print('bars off' if os.environ['HF_HUB_DISABLE_PROGRESS_BARS'] == '1' else 'bars on')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "bars off", done.stderr[-2000:]
