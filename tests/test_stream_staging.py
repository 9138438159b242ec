"""One task of a streaming micro-batch without Spark (`memwal_df.spark.stream_sink`): its rows staged
and written to a real table equal a dict model of the sink's order contract (per key the greatest
`order_by` value, NULL lowest, then the last row), deletes by flag, typed errors for bad input with
the table intact, and a stale attempt of a committed batch refused before it writes."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.reference import stored_rows

import memwal_df as mw
from memwal_df.errors import (
    InvalidConfigError,
    MissingColumnsError,
    NullDeleteFlagError,
    NullPrimaryKeyError,
    SchemaMismatchError,
    WriterFencedError,
)
from memwal_df.format import stream_commits

pytest.importorskip("pyspark")

from pyspark.sql.types import BooleanType, DoubleType, LongType, StringType, StructField, StructType  # noqa: E402

from memwal_df.spark.staging import RegionStage, write_regions  # noqa: E402
from memwal_df.spark.stream_sink import StreamBatch, stage_stream, stream_job  # noqa: E402

TABLE = pa.schema([("id", pa.int64()), ("value", pa.float64())])
STREAM = StructType(
    [
        StructField("id", LongType()),
        StructField("value", DoubleType()),
        StructField("deleted", BooleanType()),
        StructField("seq", LongType()),
    ]
)
OPTIONS = {"delete_column": "deleted", "order_by": "seq"}


INPUT = pa.schema([("id", pa.int64()), ("value", pa.float64()), ("deleted", pa.bool_()), ("seq", pa.int64())])


def new_table(path: Any) -> Any:
    return mw.create_table(str(path), TABLE, "id", region_spec=mw.bucket("id", 3))


def run_task(table: Any, job: StreamBatch, batches: list[pa.RecordBatch], memory: int = 1 << 20) -> None:
    with RegionStage(job.stage_schema(table), memory) as stage:
        stage_stream(table, batches, job, stage)
        write_regions(table, stage, job, job.holder(0))


def batch_job(table: Any, options: dict[str, str] = OPTIONS, schema: StructType = STREAM) -> StreamBatch:
    return replace(stream_job(table, schema, options), query=str(uuid.uuid4()), batch=0)


def model_of(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The sink's contract for one partition: per key the greatest (seq, NULL lowest; position)."""
    model: dict[int, dict[str, Any]] = {}
    ranked = sorted(enumerate(rows), key=lambda p: (p[1]["seq"] is not None, p[1]["seq"] or 0, p[0]))
    for _, row in ranked:
        if row["deleted"]:
            model.pop(row["id"], None)
        else:
            model[row["id"]] = {"id": row["id"], "value": row["value"]}
    return model


event = st.fixed_dictionaries(
    {
        "id": st.integers(0, 12),
        "value": st.floats(-1e6, 1e6, allow_nan=False),
        "deleted": st.booleans(),
        "seq": st.none() | st.integers(0, 6),  # ties and NULLs
    }
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(event, max_size=40), cut=st.integers(1, 10), memory=st.sampled_from([0, 1 << 20]))
def test_a_task_writes_the_newest_row_per_key(tmp_path_factory, rows, cut, memory):
    """Rows in several Arrow batches, staged in memory or spilled to files, against the model."""
    table = new_table(tmp_path_factory.mktemp("t") / "t")
    data = pa.Table.from_pylist(rows, schema=INPUT)
    run_task(table, batch_job(table), data.to_batches(max_chunksize=cut), memory)
    assert stored_rows(table) == model_of(rows)


def test_without_order_by_the_last_row_wins_and_later_batches_win(tmp_path):
    table = new_table(tmp_path / "t")
    plain = {"delete_column": "deleted"}
    flags = [False, True, False, True]
    first = pa.table({"id": [1, 2, 1, 3], "value": [1.0, 2.0, 3.0, 4.0], "deleted": flags})
    job = batch_job(table, plain, StructType(STREAM.fields[:3]))
    run_task(table, job, first.to_batches())
    assert stored_rows(table) == {1: {"id": 1, "value": 3.0}}
    second = pa.table({"id": [1, 3], "value": [None, 5.0], "deleted": [True, False]})
    run_task(table, replace(job, batch=1), second.to_batches())
    assert stored_rows(table) == {3: {"id": 3, "value": 5.0}}
    keys = pa.table({"id": [3, 4]})
    deletes = stream_job(table, StructType(STREAM.fields[:1]), {"operation": "delete"})
    run_task(table, replace(deletes, query=job.query, batch=2), keys.to_batches())
    assert stored_rows(table) == {}


def test_bad_rows_fail_the_task_before_it_writes(tmp_path):
    table = new_table(tmp_path / "t")
    job = batch_job(table)
    good = {"id": 1, "value": 1.0, "deleted": False, "seq": 1}
    for bad, error in (
        ({**good, "deleted": None}, NullDeleteFlagError),
        ({**good, "id": None}, NullPrimaryKeyError),
        ({**good, "id": None, "deleted": True}, NullPrimaryKeyError),
    ):
        data = pa.Table.from_pylist([good, bad], schema=INPUT)
        with pytest.raises(error):
            run_task(table, job, data.to_batches())
        assert stored_rows(table) == {}


def test_options_and_stream_columns_are_checked_on_the_driver(tmp_path):
    table = new_table(tmp_path / "t")
    for options, schema, error in (
        ({"operation": "merge"}, STREAM, InvalidConfigError),
        ({"operation": "delete", "delete_column": "deleted"}, STREAM, InvalidConfigError),
        ({"delete_column": "gone"}, STREAM, MissingColumnsError),
        ({"delete_column": "seq"}, STREAM, SchemaMismatchError),  # not boolean
        ({"order_by": "seq"}, STREAM, SchemaMismatchError),  # `deleted` is not a table column
        ({}, StructType([*STREAM.fields[:1], StructField("v", StringType())]), SchemaMismatchError),
        ({"operation": "delete"}, STREAM, SchemaMismatchError),  # keys only
    ):
        with pytest.raises(error):
            stream_job(table, schema, options)


def test_a_stale_attempt_of_a_committed_batch_writes_nothing(tmp_path):
    table = new_table(tmp_path / "t")
    job = batch_job(table)
    stream_commits.record(table.storage, job.query, 3, rows=0, regions=0)  # the query is past it
    data = pa.table({"id": [1], "value": [1.0], "deleted": [False], "seq": [0]})
    with pytest.raises(WriterFencedError, match="stale"):
        run_task(table, job, data.to_batches())
    assert stored_rows(table) == {}
    run_task(table, replace(job, batch=4), data.to_batches())
    assert stored_rows(table) == {1: {"id": 1, "value": 1.0}}
    assert np.array_equal(stream_commits.batches(table.storage, job.query), [3])
