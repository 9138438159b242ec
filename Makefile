# memwal_df: every target sets up .venv on first use, so a fresh clone needs only `make test` / `make demo`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-slow test-spark test-s3 reliability demo bench bench-spark protos lint docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,dev,spark,bench]'
	touch $(STAMP)

# Two workers (the suite's tests wait on processes, servers and fsyncs as much as they compute); a
# test file runs whole on one worker.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The Spark suite (local[2], Java 17); the stamp installs every extra (spark, bench's matplotlib).
test-spark: $(STAMP)
	$(BIN)/python -m pytest -q -m spark

# The reliability tests, default sample and slow cases, then docs/guarantees.md from their figures.
RELIABILITY := tests/test_crash.py tests/test_crash_jobs.py tests/test_faults.py tests/test_bad_input.py \
	tests/test_corrupt_regions.py tests/test_region_integrity.py tests/test_reader_freshness.py \
	tests/test_read_state.py tests/test_load.py tests/test_power_loss.py tests/test_fsync_audit.py \
	tests/test_crash_points.py tests/test_generation_checksums.py
reliability: $(STAMP)
	MEMWAL_FIGURES=build/reliability.json $(BIN)/python -m pytest -q -m "not spark" $(RELIABILITY)
	$(BIN)/python scripts/guarantees.py build/reliability.json docs/guarantees.md

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# make bench: quick sizes; FULL=1 for the reference workload; BENCH_ARGS="--only write,read" etc.
bench: $(STAMP)
	$(BIN)/python bench/report.py $(if $(FULL),--full) $(BENCH_ARGS)

bench-spark: $(STAMP)
	$(BIN)/python bench/spark.py

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

# Ruff, then mypy over memwal_df and tests/ ([tool.mypy] in pyproject.toml: strict for the public API modules).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The API reference, HTML in build/api, from the docstrings of what memwal_df exports (its `__all__`,
# with the submodules it lists) and of memwal_df.spark; memwal_df.spark.session's page left out
# (memwal_df.spark re-exports its names).
docs: $(STAMP)
	rm -rf build/api
	$(BIN)/pdoc -d markdown -o build/api memwal_df memwal_df.spark '!memwal_df.spark.session'

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
