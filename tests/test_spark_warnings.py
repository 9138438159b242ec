"""A Spark run prints no Python warning: neither PySpark's about pandas 3 (the `spark` extra keeps
pandas below 3) nor Lance's "lance is not fork-safe" (`mws.session()` starts the JVM without forking
the driver, which has imported Lance). A small job (create, routed write through Python workers,
read back) runs in its own process, as a user's script would, and its stderr is checked."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("pyspark")

pytestmark = pytest.mark.spark

ROOT = pathlib.Path(__file__).resolve().parent.parent

JOB = """
import sys

import pyarrow as pa

import memwal_df as mw
from memwal_df import spark as mws

uri = sys.argv[1]
schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
mw.create_table(uri, schema, "id", region_spec=mw.bucket("id", 2))
spark = mws.session()
mws.write(spark.range(100).selectExpr("id", "cast(id AS string) AS v"), uri)
print("rows:", spark.read.format("memwal").load(uri).count())
spark.stop()
"""


def test_a_spark_job_prints_no_python_warning(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PYTHONWARNINGS", None)  # Python's default warning filters, as a user has them
    run = subprocess.run(
        [sys.executable, "-c", JOB, str(tmp_path / "t")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert "rows: 100" in run.stdout
    assert "fork-safe" not in run.stderr, run.stderr
    assert "pandas >= 3.0.0" not in run.stderr, run.stderr
    assert not re.search(r"\b\w+Warning: ", run.stderr), run.stderr
