"""The SGLang CPU venv builder and the pure-torch sgl_kernel stand-in (no SGLang needed)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from agentrl.engines.sglang_cpu import env
from agentrl.engines.sglang_cpu.server import launch_sglang_cpu_server, process_group_rss_bytes, sglang_cpu_specs
from agentrl.errors import EngineUnavailable

# The stand-in registers torch.ops.sgl_kernel.* on import: import it once, under its package name.
shim = importlib.import_module("agentrl.engines.sglang_cpu.shim.sgl_kernel")


def test_assign_req_to_token_pool_writes_each_requests_new_slots_into_its_row():
    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    shim.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),  # request 0 lives in row 2, request 1 in row 0
        req_to_token,
        torch.tensor([3, 0]),
        torch.tensor([5, 4]),
        torch.tensor([11, 12, 21, 22, 23, 24]),
        10,
    )
    expected = torch.zeros(4, 10, dtype=torch.int32)
    expected[2, 3:5] = torch.tensor([11, 12])
    expected[0, 0:4] = torch.tensor([21, 22, 23, 24])
    assert torch.equal(req_to_token, expected)


def test_assign_req_to_token_pool_is_reachable_as_a_torch_op_and_skips_empty_requests():
    req_to_token = torch.full((2, 4), -1, dtype=torch.int64)
    torch.ops.sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor([0, 1]), req_to_token, torch.tensor([2, 1]), torch.tensor([2, 3]), torch.tensor([7, 8]), 4
    )
    assert req_to_token.tolist() == [[-1, -1, -1, -1], [-1, 7, 8, -1]]


def test_assign_req_to_token_pool_rejects_an_end_past_the_pool_length():
    with pytest.raises(ValueError, match="end offset 5 is past the pool length 4"):
        shim.assign_req_to_token_pool_cpu(
            torch.tensor([0]), torch.zeros(1, 4, dtype=torch.int32), torch.tensor([3]), torch.tensor([5]), torch.tensor([1, 2]), 4
        )


def test_copy_all_layer_kv_cache_moves_rows_of_every_buffer_through_raw_addresses():
    k = torch.arange(24, dtype=torch.float32).view(6, 4)
    v = torch.arange(100, 148, dtype=torch.float16).view(6, 8)  # another dtype and row width
    k_before, v_before = k.clone(), v.clone()
    ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([k.stride(0) * k.element_size(), v.stride(0) * v.element_size()])
    # Swap rows 1 and 4 and copy row 0 to row 2: every source is read before any write.
    torch.ops.sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1, 4, 2]), torch.tensor([4, 1, 0]))
    for after, before in ((k, k_before), (v, v_before)):
        assert torch.equal(after[[1, 4, 2]], before[[4, 1, 0]])
        assert torch.equal(after[[0, 3, 5]], before[[0, 3, 5]])


def test_sgl_kernel_names_sglang_imports_but_never_calls_here_fail_loudly():
    with pytest.raises(NotImplementedError, match="sgl_kernel.verify_tree_greedy_cpu is not provided"):
        shim.verify_tree_greedy_cpu()


def test_missing_venv_gives_a_skip_reason_with_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv(env.VENV_ENV_VAR, str(tmp_path / "absent"))
    assert env.venv_dir() == tmp_path / "absent"
    assert not env.is_ready()
    assert env.unavailable_reason() == (
        f"no SGLang CPU venv at {tmp_path / 'absent'}; build it with "
        f"`python -m agentrl.engines.sglang_cpu build` (or set {env.VENV_ENV_VAR})"
    )


def test_best_effort_build_exits_zero_and_records_why_it_was_impossible(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(env.VENV_ENV_VAR, str(tmp_path / "venv"))
    monkeypatch.setattr(env, "REQUIRED_FREE_BYTES", 2**60)  # no disk is that large
    assert env.cli_main(["build"]) == 1
    assert env.cli_main(["build", "--best-effort"]) == 0
    assert "sglang venv not built:" in capsys.readouterr().err
    reason = env.unavailable_reason()
    assert reason.startswith(f"the SGLang CPU venv at {tmp_path / 'venv'} failed to build (")
    assert "GiB free under" in reason and "needs about" in reason
    assert env.cli_main(["status"]) == 1


def test_build_does_nothing_once_the_ready_marker_is_written(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    (venv / env.READY_MARKER).write_text("{}\n")

    def no_commands(*args, **kwargs):
        raise AssertionError("a ready venv must not run pip again")

    monkeypatch.setattr(env, "_run", no_commands)
    assert env.build(venv) == venv
    assert env.unavailable_reason(venv) is None


def test_cpu_spec_runs_sglang_from_its_venv_with_the_cpu_flags_and_the_stand_in_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    [spec] = sglang_cpu_specs(tmp_path / "model", ports=[30123], threads=1, venv=tmp_path / "venv")
    assert spec.command[:3] == [str(tmp_path / "venv" / "bin" / "python"), "-m", "sglang.launch_server"]
    joined = " ".join(spec.command)
    for flag in (
        f"--model-path {tmp_path / 'model'}", "--device cpu", "--attention-backend torch_native",
        "--sampling-backend pytorch", "--disable-overlap-schedule", "--dtype float32",
        "--max-total-tokens 65536", "--skip-server-warmup", "--port 30123", "--host 127.0.0.1",
    ):  # fmt: skip
        assert flag in joined
    assert spec.env["PYTHONPATH"] == f"{env.SHIM_DIR}{os.pathsep}/elsewhere"
    assert (env.SHIM_DIR / "sgl_kernel" / "__init__.py").is_file()
    assert spec.env["SGLANG_USE_CPU_ENGINE"] == "1" and spec.env["OMP_NUM_THREADS"] == "1"
    assert spec.url == "http://127.0.0.1:30123"


def test_process_group_rss_counts_this_process_group():
    assert process_group_rss_bytes(os.getpgrp()) > 10 * 2**20  # at least this python with torch
    assert process_group_rss_bytes(2**22 + 12345) == 0  # no such group


def test_launch_without_the_venv_raises_engine_unavailable_before_spawning(tmp_path):
    with pytest.raises(EngineUnavailable, match="no SGLang CPU venv at .*absent"):
        launch_sglang_cpu_server(tmp_path, venv=tmp_path / "absent")


def test_launch_refuses_a_directory_that_is_not_a_model(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    (venv / env.READY_MARKER).write_text("{}\n")
    with pytest.raises(EngineUnavailable, match="has no config.json: not a model directory"):
        launch_sglang_cpu_server(tmp_path / "empty", venv=venv)
