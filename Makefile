# make run    set up .venv (first time) and run the main job on the shipped data
# make test   set up .venv (first time) and run the test suite
# make test-fast  the in-process tests only (no multi-rank runs), for the edit loop
# make lint   ruff
# VENV=/path  use another virtual environment; ARGS="..." extra arguments
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.titan-bootstrap
TEST_PATHS := tests $(wildcard plugins/*/tests) $(wildcard examples/*/tests)
ARGS ?=

.PHONY: venv run test test-fast lint clean

venv: $(STAMP)

$(STAMP): scripts/bootstrap.sh $(wildcard requirements/*.txt) \
          pyproject.toml $(wildcard plugins/*/pyproject.toml) $(wildcard examples/*/pyproject.toml)
	PYTHON=$(PYTHON) bash scripts/bootstrap.sh $(VENV)
	touch $@

run: venv
	$(BIN)/titan-run model=deepseek_v3 parallelism=fsdp4_tp2_ep2 $(ARGS)

test: venv
	$(BIN)/python -m pytest -q $(TEST_PATHS) $(ARGS)

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow and not titan_slow" $(TEST_PATHS) $(ARGS)

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
