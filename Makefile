# Fresh machine: `make run` (set up and run the pipeline) or `make test` (set up and run the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(abspath $(VENV))/bin
TORCH ?= torch==2.13.0

.PHONY: run test lint clean-venv timings

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

test: $(VENV)/.installed
	PATH="$(BIN):$$PATH" $(PY) -m pytest -q -ra tests

timings: $(VENV)/.installed
	PATH="$(BIN):$$PATH" $(PY) scripts/timings.py

clean-venv:
	rm -rf $(VENV)
