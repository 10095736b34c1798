# Fresh machine: `make run` (set up and run the pipeline) or `make test` (set up and run the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(abspath $(VENV))/bin
TORCH ?= torch==2.13.0

.PHONY: run test test-fast test-gpu lint check-locks clean-venv timings

$(VENV)/.installed: pyproject.toml requirements.lock requirements-dev.lock
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -r requirements.lock -r requirements-dev.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $@

run: $(VENV)/.installed
	test -d .git || (git init -q && git add -A && git -c user.name=amp -c user.email=amp@localhost commit -qm "initial import")
	test -d .dvc || ($(BIN)/dvc init -q && git add .dvc && git -c user.name=amp -c user.email=amp@localhost commit -qm "dvc init")
	PATH="$(BIN):$$PATH" $(BIN)/dvc repro
	@echo "Results: $(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db  (then open http://127.0.0.1:5000)"

# Every test (what CI runs): pytest 1105 s from a fresh clone (25 min with install, lint and check-locks) on 2 cores of an
# AMD EPYC with AVX-512 (2026-12-06, third session: 966 passed; FSDP2 benchmark, DCP folders, FSDP2 mixed-precision
# accept/rollback and torch-compat tests added); 975 s earlier that day (FSDP2, multi-node, checkpoint, inference-only,
# newcomer and full-disk e2e tests added);
# 593 s earlier that day (two FP32 replicates per freeze, the calibration and failed-variant e2e tests); 452 s from a fresh clone, install included (pytest 382-432 s), on 2 idle cores of an Intel Xeon
# with AVX-512 (2026-12-05); 480-555 s on an AMD EPYC with AVX-512 (2026-12-04/05); 16.7-18.7 min on an AMD EPYC with
# AVX2 only (2026-12-03); 9.8-12.4 min on an Intel Xeon with AVX-512 (2026-12-01). The goal is 8 min; about half the CPU
# time is `import torch` and `import torch._dynamo` in stage processes (docs/ci.md).
# Paired, within one hour on the Xeon: 592 s with three workers, 660 s with two.
# pytest-xdist, one worker per core plus one: most tests wait on single-threaded subprocesses (dvc repro, a stage, a
# server) and on servers starting, so with one worker per core the CPUs were idle 9 % of the time; a third worker fills
# that (user + sys 1074 s over 592 s of wall time). A test is a unit of work of its own, except that the tests sharing
# a module-scoped fixture go to one worker together (loadgroup: tests/conftest.py groups them and hands the long units
# out first, so that the short unit tests fill the workers at the end). loadgroup needs pytest 8
# (requirements-dev.lock): under pytest 9 it falls back to per-test units, and tests/test_scheduling.py fails.
WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
test: $(VENV)/.installed
	PATH="$(BIN):$$PATH" OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra --durations=10 -n $(WORKERS) --dist loadgroup --no-loadscope-reorder tests

# Pure and unit tests only (53-55 s on the AVX-512 EPYC on 2026-12-06; 71-106 s on the AVX2 EPYC, 46-57 s on the Xeon, 2 cores idle, one worker per core; 56-63 s
# with one more on the Xeon: these tests keep their CPU busy): no dvc repro, no server, no GPU.
test-fast: $(VENV)/.installed
	PATH="$(BIN):$$PATH" OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n auto -m "not integration and not gpu" tests

# Only the GPU tests, inside a GPU image (see .github/workflows/gpu.yml).
test-gpu: $(VENV)/.installed
	PATH="$(BIN):$$PATH" $(PY) -m pytest -q -ra -m gpu tests

# Python (ruff), the Dockerfiles (hadolint) and the workflows (actionlint): every linter comes from requirements-dev.lock.
lint: $(VENV)/.installed
	$(BIN)/ruff check pipeline tests scripts
	$(BIN)/hadolint Dockerfile.cuda Dockerfile.rocm
	$(BIN)/actionlint

# Every pinned package has a distribution for each image's declared Python (asks the package index: not a test, the
# tests talk to 127.0.0.1 only). .ci/run runs it.
check-locks: $(VENV)/.installed
	$(PY) scripts/check_locks.py

timings: $(VENV)/.installed
	PATH="$(BIN):$$PATH" $(PY) scripts/timings.py

# examples/NAME.params.yaml = params.yaml + examples/overrides/NAME.yaml (run after editing either; tests/test_examples.py checks).
.PHONY: examples
examples: $(VENV)/.installed
	$(PY) scripts/make_examples.py

clean-venv:
	rm -rf $(VENV)
