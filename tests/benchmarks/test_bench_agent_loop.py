"""The agent-loop benchmark command runs and reports what it promises (figures: docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_agent_loop_prints_one_json_object_with_its_keys():
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "bench", "agent-loop", "--json", "--trajectories", "40", "--inflight", "100"],
        capture_output=True, text=True, check=True, timeout=300,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"turns_per_s", "overhead_p50_ms", "overhead_p99_ms", "inflight_max", "rss_mib_at_inflight_max", "settings"} <= set(result)
    assert result["inflight_max"] == 100
    assert result["turns_per_s"] > 0 and result["overhead_p99_ms"] >= result["overhead_p50_ms"] > 0
