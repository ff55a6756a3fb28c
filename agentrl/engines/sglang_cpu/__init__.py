"""Real SGLang on a CPU: its cached venv, a pure-torch ``sgl_kernel`` stand-in, and a launcher.

- ``env``: builds and finds the venv (standard library only, so it runs before anything else).
- ``server``: ``launch_sglang_cpu_server(model_dir)`` starts a server and waits until it generates.
- ``shim/``: never imported by agentrl; it goes first on the server process's ``PYTHONPATH``.
"""

from agentrl.engines.sglang_cpu.env import BuildError, is_ready, unavailable_reason, venv_dir

__all__ = ["BuildError", "is_ready", "unavailable_reason", "venv_dir"]
