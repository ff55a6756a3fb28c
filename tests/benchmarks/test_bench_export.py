"""`agentrl bench export` times the disk writer against safetensors alone and save_pretrained, and
the reload (figures for the 0.5B shape: docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_export_times_the_writer_the_raw_write_and_the_reload_of_the_same_bytes():
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "bench", "export", "--shape", "tiny", "--repeats", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["shape"] == "tiny" and out["dtype"] == "float32" and out["repeats"] == 2
    assert out["bytes"] > 4 * out["parameters"] - 4 * 1060 * 64  # fp32, the tied head written once
    assert {len(v) for v in out["all_s"].values()} == {2}
    assert out["export_over_raw"] == pytest.approx(out["export_s"] / out["raw_s"], rel=0.02)
    assert out["export_over_raw_paired_median"] > 0
    assert out["sync_s"] == pytest.approx(out["export_s"] + out["load_s"], abs=1e-3)
    assert "model.safetensors" in out["files"] and "config.json" in out["files"] and "tokenizer.json" in out["files"]
