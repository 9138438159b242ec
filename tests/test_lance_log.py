"""Lance's native log in normal operation: merges print no ERROR line, whether memwal_df or `lance` is
imported first and whether or not the primary key has a scalar index; a `LANCE_LOG` the user set is
kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Two rounds of upserts and deletes, each merged; `index` adds a BTREE index on the key after round 1.
SCRIPT = """
import sys, os
if sys.argv[1] == "lance":
    import lance
import pyarrow as pa
import memwal_df as mw
import lance
uri = sys.argv[3]
schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
t = mw.create_table(uri, schema, "id", region_spec=mw.bucket("id", 2))
for round in range(2):
    with t.writer() as w:
        w.put(pa.table({"id": [1, 2, 3], "v": ["a", "b", "c"]}))
        w.delete([2])
    t.merge()
    if sys.argv[2] == "index" and round == 0:
        lance.dataset(uri).create_scalar_index("id", "BTREE")
assert t.dataset.count_rows() == 2
print(os.environ.get("LANCE_LOG"))
"""


def run_merges(
    tmp_path: Path, first: str, index: str, lance_log: str | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LANCE_LOG"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if lance_log is not None:
        env["LANCE_LOG"] = lance_log
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, first, index, str(tmp_path / "t")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return run


@pytest.mark.parametrize(
    ("first", "index"), [("memwal_df", "none"), ("memwal_df", "index"), ("lance", "none")]
)
def test_merges_log_no_error_line(tmp_path, first, index):
    run = run_merges(tmp_path, first, index)
    assert "ERROR" not in run.stderr, run.stderr


def test_a_lance_log_the_user_set_is_kept(tmp_path):
    run = run_merges(tmp_path, "memwal_df", "index", lance_log="warn")
    assert run.stdout.strip() == "warn"
    assert "Index __lance_mem_wal has no fields" in run.stderr  # Lance's own filter: the line shows
