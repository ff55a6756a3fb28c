#!/usr/bin/env bash
# Build (or reuse) the cached SGLang CPU venv for the `sglang`-marked tests. Always exits 0: when
# the build is impossible the reason is recorded and those tests skip with it.
# Path: ~/.cache/agentrl/sglang-venv-0.5.23 (override with AGENTRL_SGLANG_VENV). A cold build
# downloads about 11 GB; it gives up after SGLANG_ENV_TIMEOUT seconds (default 840).
cd "$(dirname "$0")/.."
python=".venv/bin/python"
[ -x "$python" ] || python=python3
exec "$python" -m agentrl.engines.sglang_cpu build --best-effort --timeout "${SGLANG_ENV_TIMEOUT:-840}"
