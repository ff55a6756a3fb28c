"""Start real SGLang servers on a CPU (the ``launch.py`` launcher with the CPU recipe).

What makes SGLang 0.5.23 serve on a plain x86 CPU: its own venv (``env.py``),
``SGLANG_USE_CPU_ENGINE=1``, the pure-torch ``sgl_kernel`` stand-in first on the server's
``PYTHONPATH`` (``shim/``), and the flags in ``CPU_FLAGS``. Each server is a process group of
three processes (HTTP front, scheduler, detokenizer), gigabytes of RSS together; stopping it
ends all three. Per-request ``sampling_seed`` is ignored on this path: SGLang honours it only
with ``--enable-deterministic-inference``, which refuses the ``torch_native`` attention backend.

    with launch_sglang_cpu_server(model_dir) as servers:
        engine = SGLangEngine(servers.urls, api_key=servers.api_key)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from agentrl.engines.launch import LaunchedServers, ServerSpec, launch_servers, sglang_specs
from agentrl.engines.sglang_cpu.env import SHIM_DIR, unavailable_reason, venv_dir, venv_python
from agentrl.errors import EngineUnavailable

__all__ = ["CPU_FLAGS", "sglang_cpu_specs", "launch_sglang_cpu_server", "process_group_rss_bytes"]

# Why each flag: the only attention and sampling backends of the CPU engine that need no compiled
# kernels; overlap scheduling assumes CUDA streams; fp32 because bf16 is many times slower on
# this CPU; the launcher's own readiness check (/health_generate) replaces SGLang's warm-up;
# --sleep-on-idle because an idle scheduler otherwise polls its sockets on a full core (1.02 CPU
# seconds per second measured idle, 0.018 with the flag), which on a CPU machine is taken from
# the trainer between rollouts.
# --max-total-tokens is added separately: without it SGLang reserves most of the machine's
# memory for KV cache (figures in docs/benchmarks.md).
CPU_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-overlap-schedule",
    "--dtype", "float32",
    "--skip-server-warmup",
    "--sleep-on-idle",
)  # fmt: skip


def sglang_cpu_specs(
    model_path: str | Path,
    *,
    num_servers: int = 1,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    max_total_tokens: int = 65536,
    threads: int = 2,
    extra_args: Sequence[str] = (),
    venv: Path | None = None,
    api_key: str | None = None,
) -> list[ServerSpec]:
    """Specs for ``launch_servers``: SGLang from its venv, on the CPU, the stand-in first on its path."""
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(SHIM_DIR), os.environ.get("PYTHONPATH", "")) if p),
        "SGLANG_USE_CPU_ENGINE": "1",
        "OMP_NUM_THREADS": str(threads),
    }
    flags = [*CPU_FLAGS, "--max-total-tokens", str(max_total_tokens), *extra_args]
    specs = sglang_specs(model_path, num_servers=num_servers, python=venv_python(venv), host=host, ports=ports, extra_args=flags,
                         api_key=api_key)
    return [replace(spec, env={**spec.env, **env}) for spec in specs]


def launch_sglang_cpu_server(
    model_path: str | Path,
    *,
    ready_timeout_s: float = 120.0,
    log_dir: str | Path | None = None,
    venv: Path | None = None,
    **spec_options,
) -> LaunchedServers:
    """Start ``sglang_cpu_specs(...)`` servers and return once each has generated a token.

    Raises ``EngineUnavailable`` before spawning anything when the venv is not built or the
    model directory has no ``config.json``; the launcher raises it with the end of the server
    log when a server exits or is not ready within ``ready_timeout_s`` (and stops them all).
    """
    venv = venv or venv_dir()
    reason = unavailable_reason(venv)
    if reason is not None:
        raise EngineUnavailable(reason)
    if not (Path(model_path) / "config.json").is_file():
        raise EngineUnavailable(f"{model_path} has no config.json: not a model directory SGLang can serve")
    specs = sglang_cpu_specs(model_path, venv=venv, **spec_options)
    return launch_servers(specs, ready_timeout_s=ready_timeout_s, log_dir=log_dir)


def process_group_rss_bytes(pgid: int) -> int:
    """Resident memory of the live processes of a process group (a server's is its leader's pid)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # the command name may hold spaces
        except OSError:
            continue  # the process ended while we listed it
        if int(fields[2]) == pgid and fields[0] != "Z":
            total += int(fields[21]) * page
    return total
