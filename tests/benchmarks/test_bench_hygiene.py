"""Benchmarks leave the temp dir as they found it: on success, on error and on SIGTERM.

Each run gets a fresh, empty TMPDIR. The two caches that outlive a run on purpose live outside
it: the tiny models (``AGENTRL_CACHE``) and torch's compile cache, whose empty folder torch makes
when ``torch._dynamo`` is imported (``TORCHINDUCTOR_CACHE_DIR``); neither is the benchmark's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agentrl_benchmarks import engine as engine_bench
from agentrl_benchmarks._scratch import private_ray_temp_dir, scratch_dir


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("caches")
    return {"AGENTRL_CACHE": str(root / "agentrl"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}


@pytest.fixture
def fresh_tmpdir() -> Path:
    """Short on purpose: Ray puts unix sockets (at most 107 bytes a path) under it."""
    path = Path(tempfile.mkdtemp(prefix="h"))
    yield path
    for leftover in path.iterdir():  # a failed assertion must not leave them either
        subprocess.run(["rm", "-rf", str(leftover)], check=False)
    path.rmdir()


def _run(args: list[str], tmpdir: Path, caches: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, **caches, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_TMPDIR", None)
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "bench", *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_engine_quick_smoke_leaves_the_temp_dir_empty(fresh_tmpdir, caches):
    done = _run(
        ["engine", "--json", "--quick", "--models", "1m", "--concurrency", "2", "--engines", "builtin,hf_static,hf_cb", "--threads", "1",
         "--hf-cb-cache", "workload"],
        fresh_tmpdir, caches, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    # every engine on the multi-turn sessions, then on the decode-only workload (at the highest concurrency)
    assert [(row["engine"], row["workload"]) for row in report["results"]] == [
        (engine, workload) for workload in ("multi_turn", "decode_only") for engine in ("builtin", "hf_static", "hf_cb")]
    # the same tokens on every engine (no stop token), and a time to first token from each
    assert len({(row["workload"], row["generated_tokens"]) for row in report["results"]}) == 2
    assert all(row["ttft_p99_ms"] > 0 for row in report["results"])
    assert {r["workload"] for r in report["ratios"]} == {"multi_turn", "decode_only"} and all("builtin_over_hf_cb" in r for r in report["ratios"])
    # the decode step taken apart at the decode-only workload's rows: at the run's own context (its
    # rows all there), then at two spreads of contexts (2 rows around 128: 42 and 127; around 384: 128 and 384)
    anatomy = report["decode_step_anatomy"]
    assert anatomy[0]["rows"] == 2 and anatomy[0]["mean_context"] > 0
    assert [(a["rows"], a["mean_context"]) for a in anatomy[1:]] == [(2, 84.5), (2, 256.0)]
    for part in anatomy:
        assert part["linears_and_attention_flop_fraction"] < part["linears_only_flop_fraction"]
        assert 0 < part["step_flop_fraction"] < part["linears_only_flop_fraction"]
    assert sorted(os.listdir(fresh_tmpdir)) == []


def _sglang_unavailable() -> str | None:
    from agentrl.engines.sglang_cpu.env import unavailable_reason

    return unavailable_reason()


@pytest.mark.sglang
@pytest.mark.skipif(_sglang_unavailable() is not None, reason=_sglang_unavailable() or "")
def test_engine_with_real_sglang_leaves_the_temp_dir_empty(fresh_tmpdir, caches):
    """The run that left model directories and server logs behind: SGLang also makes its IPC
    files and a kernel cache in the temp dir of its processes."""
    done = _run(
        ["engine", "--json", "--quick", "--models", "1m", "--concurrency", "2", "--engines", "sglang", "--threads", "1"],
        fresh_tmpdir, caches, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["engine"] for row in json.loads(done.stdout)["results"]] == ["sglang"]
    assert sorted(os.listdir(fresh_tmpdir)) == []


def test_engine_removes_the_model_it_saved_for_sglang_when_the_run_fails(tmp_path, monkeypatch, caches):
    """The SGLang rows save the model for the server first; a server that fails must not strand it."""
    fresh = tmp_path / "tmp"
    fresh.mkdir()
    for name, value in caches.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", str(fresh))
    monkeypatch.setattr(engine_bench, "_sglang_unavailable", lambda: None)
    saved: list[Path] = []

    def failing_server(model_dir, sessions, concurrency, vocab, work):
        assert (model_dir / "config.json").is_file() and model_dir.is_relative_to(fresh)
        saved.append(model_dir)
        raise RuntimeError("server exited during start-up")

    monkeypatch.setattr(engine_bench, "run_sglang", failing_server)
    with pytest.raises(RuntimeError, match="server exited during start-up"):
        engine_bench.main(["--models", "1m", "--concurrency", "1", "--engines", "sglang", "--threads", "1"])
    assert len(saved) == 1 and not saved[0].exists()
    assert sorted(os.listdir(fresh)) == []


def test_data_reader_writes_its_parquet_file_under_the_scratch_dir_only(fresh_tmpdir, caches):
    env = {**os.environ, **caches, "TMPDIR": str(fresh_tmpdir)}
    done = subprocess.run(
        [sys.executable, "-m", "agentrl_benchmarks.data_reader", "--rows", "3000", "--batch-size", "64", "--batches", "2", "--cache-mib", "16"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["rows"] == 3000 and result["row_groups"] == 3  # 1,024 rows a group
    assert sorted(os.listdir(fresh_tmpdir)) == []


def test_scratch_dir_is_removed_on_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError):
        with scratch_dir("t") as work:
            (work / "model").mkdir()
            (work / "model" / "weights.bin").write_bytes(b"0" * 1024)
            raise ValueError("boom")
    assert not work.exists() and list(tmp_path.iterdir()) == []


def test_scratch_dir_given_to_keep_is_kept(tmp_path):
    with scratch_dir("t", keep=tmp_path / "kept") as work:
        (work / "file").write_text("x")
    assert (tmp_path / "kept" / "file").read_text() == "x"


def test_scratch_dir_is_removed_when_the_run_is_terminated(fresh_tmpdir):
    script = (
        "import sys, time\n"
        "from agentrl_benchmarks._scratch import scratch_dir\n"
        "with scratch_dir('t') as work:\n"
        "    (work / 'model.bin').write_bytes(b'0' * 4096)\n"
        "    print(work, flush=True)\n"
        "    time.sleep(60)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(fresh_tmpdir)}, stdout=subprocess.PIPE, text=True
    )
    try:
        work = Path(process.stdout.readline().strip())
        assert work.parent == fresh_tmpdir and (work / "model.bin").is_file()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
    assert sorted(os.listdir(fresh_tmpdir)) == []


def test_private_ray_temp_dir_is_set_for_the_block_and_removed(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with private_ray_temp_dir() as ray_dir:
        assert os.environ["RAY_TMPDIR"] == str(ray_dir) and ray_dir.parent == tmp_path
        (ray_dir / "session_x").mkdir()
    assert "RAY_TMPDIR" not in os.environ and list(tmp_path.iterdir()) == []
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # someone else's cluster: its files are its own
    with private_ray_temp_dir() as ray_dir:
        assert ray_dir is None and "RAY_TMPDIR" not in os.environ


# The trainer benchmark's smoke run asserts the same of its TMPDIR (tests/benchmarks/test_bench_trainer.py).
