#!/usr/bin/env bash
# Create .venv in the repository root and install asyncllm into it (idempotent, quick when nothing changed).
# Usage: scripts/setup.sh [runtime|dev]
#   runtime: what the example needs; dev: also the test tools and the test-only references (transformers).
# torch is pinned to the CPU build 2.13.0 first, so no other requirement can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${1:-runtime}"
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($python --version)"
  "$python" -m venv .venv
fi

stamp=".venv/.asyncllm-setup-$profile"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
echo "[setup] installing torch==2.13.0 (CPU) and asyncllm[$profile] into .venv"
pip install "torch==2.13.0"
if [ "$profile" = "dev" ]; then
  pip install -e ".[dev]"
else
  pip install -e .
fi
echo "$want" > "$stamp"
