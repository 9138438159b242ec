"""Every example runs and checks itself on small data (`make demo` runs examples/demo.py): each
`main()` compares what it read with what it wrote and returns 0 only when they agree. Run as scripts
without a directory, they work in a temporary directory and remove it: each runs with TMPDIR set to
a new empty directory, which must be empty again afterwards, and writes nothing into its cwd."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DIRECTORY_EXAMPLES = [
    "quickstart",
    "streaming_ingest",
    "search_sql",
    "embed_datafusion",
    "change_feed",
    "serve",
]
OTHER_TESTS = {"spark_ingest", "spark_streaming"}  # run by the Spark tests (make test-spark)


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_run_here():
    found = {p.stem for p in EXAMPLES.glob("*.py")}
    assert found - OTHER_TESTS == {"demo", "s3", *DIRECTORY_EXAMPLES}


def run_script(name: str, tmp_path: pathlib.Path, *args: str) -> str:
    """Run example `name` as a script in a new cwd with TMPDIR a new empty directory; its output.
    Fails unless it exits 0 and leaves TMPDIR and the cwd as it found them."""
    cwd, scratch = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    scratch.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(scratch),
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in scratch.iterdir()) == [], f"{name} left these in its temporary directory"
    assert sorted(p.name for p in cwd.iterdir()) == [], f"{name} left these in its working directory"
    return run.stdout


def test_demo_runs_and_its_read_back_matches_its_model(tmp_path):
    out = run_script("demo", tmp_path)
    assert "read-back equals the model of every write: OK" in out and "MISMATCH" not in out


@pytest.mark.parametrize("name", DIRECTORY_EXAMPLES)
def test_example(name, tmp_path):
    run_script(name, tmp_path)


@pytest.mark.s3
def test_s3_example_starts_its_own_server(tmp_path):
    run_script("s3", tmp_path)


def test_an_example_keeps_the_directory_it_is_given(tmp_path, capsys):
    assert load("quickstart").main(str(tmp_path)) == 0
    assert "'bob', 'total': 8.0" in capsys.readouterr().out
    assert (tmp_path / "events" / "_mem_wal").is_dir()
