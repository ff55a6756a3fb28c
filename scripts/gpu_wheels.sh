#!/usr/bin/env bash
# The wheels `agentrl train` and scripts/gpu_check.py need on the lent GPU machines beyond their
# image (torch, transformers, numpy, pyarrow, pyyaml, httpx, jinja2, tokenizers, safetensors,
# anyio, click, h11, attrs ... are there; docs/gpu.md lists what is carried and why), downloaded
# into .whl/ (ignored by git) for the device tool's `carry`.
#
#   scripts/gpu_wheels.sh              # Python 3.12 wheels (the machines' python3) into .whl/
#   scripts/gpu_wheels.sh DIR 3.11     # the same releases for another Python, e.g. to check on CPU
#
# On the machine, before the command (agentrl itself is installed from the tree, for its plugin
# entry points, or from the wheel built here when that fails):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . ||
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/agentrl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
pyver="${2:-3.12}"
python="${PYTHON:-python3}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p "$dir"
# one release of each (two of one package stop the whole install there)
wheels=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  hydra-core==1.3.8 omegaconf==2.3.1
  starlette==1.10.0 uvicorn==0.54.0
)
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${wheels[@]}"
# omegaconf needs antlr4-python3-runtime 4.9.*, published as a source archive only: built here
# into a pure-Python wheel (py3-none-any), the same for every Python 3
ls "$dir"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 ||
  "$python" -m pip wheel -q --no-deps -w "$dir" antlr4-python3-runtime==4.9.3
# agentrl itself, as a fallback for the machine's build from the tree (its plugins are found
# through the entry points of an installed distribution): a subfolder, so `.whl/*.whl` leaves it out
rm -rf "$dir/agentrl"
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir/agentrl" .
du -sh "$dir"
