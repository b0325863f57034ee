# The two commands a newcomer runs. Each does its own set-up (.venv, torch==2.13.0 CPU, install, model fetch).
.PHONY: run test test-fast lint bench

run:            ## stream a real answer from the default model (SmolLM2-135M-Instruct)
	@scripts/setup.sh runtime
	@.venv/bin/python examples/stream_chat.py

test:           ## the whole test suite (real model on CPU; 2 xdist workers, one thread each on 2 cores; 18 min on a fresh 2-core Intel Xeon clone, 22 min on an AVX2-only AMD EPYC, 2026-12-04)
	@scripts/setup.sh dev
	@.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30

test-fast:      ## unit tests not marked slow: no model weights, no engine process, no kernel build at start (15-20 s quiet, 41-64 s at load 6, 2 cores)
	@scripts/setup.sh dev
	@.venv/bin/python -m pytest -q tests/unit -m "not slow"

lint:           ## ruff and mypy on the sources
	@scripts/setup.sh dev
	@.venv/bin/ruff check src tests benchmarks examples
	@.venv/bin/ruff format --check src tests benchmarks examples
	@.venv/bin/mypy

bench:          ## speed benchmarks (quick, quiet and contended, ~8 min on a quiet machine) -> docs/benchmarks.md
	@scripts/setup.sh dev
	@.venv/bin/python benchmarks/report.py --quick --contended
