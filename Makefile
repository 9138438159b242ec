# memwal_df: every target sets up .venv on first use, so a fresh clone needs only `make test` / `make demo`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-slow test-spark test-s3 demo bench bench-spark protos lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,dev,spark]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The Spark suite (local[2], Java 17): the stamp installs the `spark` extra.
test-spark: $(STAMP)
	$(BIN)/python -m pytest -q -m spark

demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP)
	$(BIN)/python bench/write.py

bench-spark: $(STAMP)
	$(BIN)/python bench/spark.py

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
