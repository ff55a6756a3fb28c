"""`agentrl bench lora --json` runs both sides on the real actor and reports what it measured
(figures: docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_lora_runs_both_sides_alternating_and_counts_adapter_parameters_exactly():
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "bench", "lora", "--json", "--model-size", "1m", "--rank", "8", "--steps", "1",
         "--repeats", "2", "--batch", "2", "--prompt-len", "8", "--response-len", "8"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["order"] == ["full", "lora", "lora", "full"]
    # 1m: hidden 128, 4 heads of 32, 2 KV heads (64), 3 layers; rank 8 on q, k, v, o:
    # 8 * ((128+128) + (128+64) + (128+64) + (128+128)) * 3 layers
    assert out["lora_trainable_params"] == 8 * (256 + 192 + 192 + 256) * 3 == 21504
    for side in ("full", "lora"):  # AdamW: two fp32 moments per trainable parameter
        assert out[f"{side}_optimizer_state_mib"] == pytest.approx(8 * out[f"{side}_trainable_params"] / 2**20)
        assert len(out[f"{side}_step_s_all"]) == 2 and out[f"{side}_step_s"] > 0 and out[f"{side}_peak_rss_mib"] > 0
    assert out["full_trainable_params"] > 40 * out["lora_trainable_params"]
