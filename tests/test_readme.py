"""The README runs as written: its Python example (paths moved into a temporary directory) and its
command-line block, through a `memwal` on PATH, in a shell, as a new user would type it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
ROOT = README.parent


def test_readme_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has a Python example"
    code = "\n".join(blocks).replace("/tmp/events", str(tmp_path / "events"))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    ctx = namespace["ctx"]
    ids = sorted(ctx.sql("SELECT id FROM t").to_arrow_table().column("id").to_pylist())
    assert ids == [1, 3]


def test_readme_command_line_runs(tmp_path):
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S) if "memwal " in b]
    script = block.replace("/tmp/docs", str(tmp_path / "docs"))
    installed = pathlib.Path(sys.executable).with_name("memwal")  # `pip install` put it there
    bin_dir = installed.parent if installed.exists() else tmp_path / "bin"
    if not installed.exists():  # an older install of the package: the same entry point, by hand
        bin_dir.mkdir()
        entry = "import sys; from memwal_df.cli import main; sys.exit(main())"
        (bin_dir / "memwal").write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "{entry}" "$@"\n')
        (bin_dir / "memwal").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    run = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert re.search(r"^2\s+streaming upserts$", out, flags=re.M)  # the fts hit
    assert re.search(r"^id\n-+\n1$", out, flags=re.M)  # the nearest vector
    assert json.loads(out[out.rindex("[") :]) == [{"n": 1}]  # after the delete, maintained
