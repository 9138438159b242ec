"""Partial upserts through Spark: the batch sink's option `partial` (staged, unrouted rows) and
`memwal_df.spark.write(partial=True)` (rows routed inside Spark), against a dict model."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

import memwal_df as mw
from memwal_df.errors import MissingColumnsError

pytest.importorskip("pyspark")

from memwal_df import spark as mws  # noqa: E402

pytestmark = pytest.mark.spark

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), ("name", pa.string()), ("n", pa.int64())])


@pytest.fixture(scope="module")
def spark():
    session = mws.session(master="local[2,4]")
    yield session
    session.stop()


def table_rows(table: mw.Table) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in mw.MemWalTable(table.uri).to_table().to_pylist()}


def test_partial_option_updates_only_the_given_columns(spark, tmp_path) -> None:
    base = [{"id": i, "name": f"n{i}", "n": i} for i in range(6)]
    table = mw.create_table(
        str(tmp_path / "t"), pa.Table.from_pylist(base, schema=SCHEMA), "id", region_spec=mw.bucket("id", 2)
    )
    model = {r["id"]: dict(r) for r in base}
    staged = spark.createDataFrame([(1, 10), (4, 40), (7, 70)], "id long, n long")
    staged.write.format("memwal").mode("append").option("partial", "true").save(table.uri)
    for k, n in [(1, 10), (4, 40), (7, 70)]:
        model[k] = {**model.get(k, {"id": k, "name": None}), "n": n}
    assert table_rows(table) == model

    routed = spark.createDataFrame([(2, "two"), (9, "nine")], "id long, name string")
    mws.write(routed, table, partial=True)
    for k, name in [(2, "two"), (9, "nine")]:
        model[k] = {**model.get(k, {"id": k, "n": None}), "name": name}
    assert table_rows(table) == model

    with pytest.raises(MissingColumnsError):  # without `partial` the rows would erase `name`
        mws.write(staged, table)
    no_key = spark.createDataFrame([("x",)], "name string")
    with pytest.raises(MissingColumnsError, match="primary-key"):
        mws.write(no_key, table, partial=True)
    assert table_rows(table) == model
