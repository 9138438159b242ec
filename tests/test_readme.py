"""The README's Python example runs as written (with its path moved into a temporary directory)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has a Python example"
    code = "\n".join(blocks).replace("/tmp/events", str(tmp_path / "events"))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    ctx = namespace["ctx"]
    ids = sorted(ctx.sql("SELECT id FROM t").to_arrow_table().column("id").to_pylist())
    assert ids == [1, 3]
