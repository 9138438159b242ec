"""Every example runs and checks itself on small data (`make demo` runs examples/demo.py): each
`main()` compares what it read with what it wrote and returns 0 only when they agree."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DIRECTORY_EXAMPLES = ["quickstart", "streaming_ingest", "search_sql", "embed_datafusion", "change_feed"]
OTHER_TESTS = {"spark_ingest"}  # run by the Spark tests (make test-spark)


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_run_here():
    found = {p.stem for p in EXAMPLES.glob("*.py")}
    assert found - OTHER_TESTS == {"demo", "s3", *DIRECTORY_EXAMPLES}


def test_demo_runs_and_its_read_back_matches_its_model(tmp_path, capsys):
    assert load("demo").main(str(tmp_path / "demo")) == 0
    out = capsys.readouterr().out
    assert "read-back equals the model of every write: OK" in out and "MISMATCH" not in out


@pytest.mark.parametrize("name", DIRECTORY_EXAMPLES)
def test_example(name, tmp_path):
    assert load(name).main(str(tmp_path)) == 0


@pytest.mark.s3
def test_s3_example_starts_its_own_server():
    assert load("s3").main([]) == 0


def test_examples_run_as_scripts(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "'bob', 'total': 8.0" in run.stdout
