# make run    set up .venv (first time) and run the main job on the shipped data
# make test   set up .venv (first time) and run the test suite
# make test-all   the test suite with the extended layout variants (a few minutes more)
# make test-fast  the in-process tests only (no multi-rank runs), for the edit loop
# make lint   ruff
# VENV=/path  use another virtual environment; ARGS="..." extra arguments
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.titan-bootstrap
TEST_PATHS := tests $(wildcard plugins/*/tests) $(wildcard examples/*/tests)
ARGS ?=
# Two pytest-xdist workers, a test file each at a time (module caches and the kit's sessions stay
# whole): in-process tests run beside the multi-rank ones on the 2-core CI box.
JOBS ?= 2

.PHONY: venv run test test-all test-fast lint clean

venv: $(STAMP)

$(STAMP): scripts/bootstrap.sh $(wildcard requirements/*.txt) \
          pyproject.toml $(wildcard plugins/*/pyproject.toml) $(wildcard examples/*/pyproject.toml)
	PYTHON=$(PYTHON) bash scripts/bootstrap.sh $(VENV)
	touch $@

run: venv
	$(BIN)/titan-run model=deepseek_v3 parallelism=fsdp4_tp2_ep2 $(ARGS)

test: venv
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile -m "not extended" $(TEST_PATHS) $(ARGS)

test-all: venv
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile $(TEST_PATHS) $(ARGS)

test-fast: venv
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile -m "not slow and not titan_slow" $(TEST_PATHS) $(ARGS)

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
