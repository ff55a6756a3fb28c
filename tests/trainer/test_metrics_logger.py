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
