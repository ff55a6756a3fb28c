"""`agentrl bench forward --json` times both forward paths on both batch shapes (figures: docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_forward_times_both_paths_on_both_batch_shapes():
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "bench", "forward", "--json", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["grpo"]["rows"] == 64 and out["sft"]["rows"] == 32
    for name in ("grpo", "sft"):
        assert out[name]["packed_s"] > 0 and out[name]["module_s"] > 0
        assert out[name]["ratio"] == pytest.approx(out[name]["module_s"] / out[name]["packed_s"], rel=1e-2)
