# memwal_df: every target sets up .venv on first use, so a fresh clone needs only `make test` / `make demo`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-slow test-s3 demo bench protos lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# Lance 14 logs a harmless "ERROR lance::index ... __lance_mem_wal has no fields" on every merge
# (docs/operations.md); the demo hides that one logger unless LANCE_LOG is set.
demo: $(STAMP)
	LANCE_LOG="$${LANCE_LOG-error,lance::index=off}" $(BIN)/python examples/demo.py

# make bench: quick sizes; FULL=1 for the reference workload; BENCH_ARGS="--only write,read" etc.
$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/pip install -q -e '.[test,dev,bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(BIN)/python bench/report.py $(if $(FULL),--full) $(BENCH_ARGS)

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
