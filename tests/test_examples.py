"""The examples run and check themselves (`make demo` runs examples/demo.py)."""

from __future__ import annotations

import importlib.util
import pathlib

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_demo_runs_and_its_read_back_matches_its_model(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("demo", EXAMPLES / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.main(str(tmp_path / "demo")) == 0
    assert "read-back equals the model of every write: OK" in capsys.readouterr().out
