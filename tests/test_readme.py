"""The README runs as written, as a new user would run it from the clone after `make test`: its Python
example verbatim, twice (it must not depend on what an earlier run left), and its command-line block
verbatim in a shell, from a directory holding the clone's `.venv`. Neither leaves files behind in the
temporary directory."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
ROOT = README.parent


def test_readme_example_runs_twice(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has a Python example"
    code = compile("\n".join(blocks), str(README), "exec")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the example's TemporaryDirectory goes
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        namespace: dict = {}
        exec(code, namespace)
        ctx = namespace["ctx"]
        ids = sorted(ctx.sql("SELECT id FROM t").to_arrow_table().column("id").to_pylist())
        assert ids == [1, 3]
        namespace["tmp"].cleanup()  # what Python does at exit
        del namespace, ctx
        gc.collect()
    assert list(scratch.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]  # nothing written into the cwd


def _venv(tmp_path: pathlib.Path) -> pathlib.Path:
    """A `.venv` as `make test` leaves it: this interpreter's venv, else one with a `memwal` script."""
    prefix = pathlib.Path(sys.prefix)
    if (prefix / "bin" / "activate").exists() and (prefix / "bin" / "memwal").exists():
        return prefix
    venv = tmp_path / "venv"  # an interpreter without a venv, or an older install of the package
    (venv / "bin").mkdir(parents=True)
    entry = "import sys; from memwal_df.cli import main; sys.exit(main())"
    (venv / "bin" / "memwal").write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{entry}" "$@"\n')
    (venv / "bin" / "memwal").chmod(0o755)
    (venv / "bin" / "activate").write_text(f'PATH="{venv / "bin"}:$PATH"\nexport PATH\n')
    return venv


def test_readme_command_line_runs_verbatim(tmp_path):
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S) if "memwal " in b]
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / ".venv").symlink_to(_venv(tmp_path))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(scratch),  # where the block's `mktemp -d` makes its directory
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    run = subprocess.run(["bash", "-e", "-c", block], cwd=clone, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert re.search(r"^2\s+streaming upserts$", out, flags=re.M)  # the fts hit
    assert re.search(r"^id\n-+\n1$", out, flags=re.M)  # the nearest vector
    assert json.loads(out[out.rindex("[") :]) == [{"n": 1}]  # after the delete, maintained
    assert sorted(p.name for p in clone.iterdir()) == [".venv"]  # the block works in its own directory
    (made,) = scratch.iterdir()
    assert sorted(p.name for p in made.iterdir()) == ["docs.jsonl", "docs.lance"]
