"""The Spark pipeline (`memwal_df.spark`), on one local[2] session: ingest and read back against a
dict model and the row-by-row oracle, routing equal to the Python writer's, reads concurrent with a
Spark ingest, Spark merge equal to `table.merge()`, a task killed mid-write, filters and pruning,
vectors both ways. Run with `make test-spark` (`pytest -m spark`)."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import pathlib
import tempfile
import threading
import uuid
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.lance_made import foreign_spec_table, lance_made_table
from support.optional import not_none
from support.reference import model_rows, stored_rows

import memwal_df as mw
from memwal_df.errors import (
    NonKeyRegionColumnError,
    RegionRoutingError,
    SchemaMismatchError,
    WriterFencedError,
)
from memwal_df.format import layout, lease
from memwal_df.format.wal import Wal
from memwal_df.write.table_writer import TableWriter, region_of_row

pytest.importorskip("pyspark")

from memwal_df import spark as mws  # noqa: E402
from memwal_df.spark.source import MemWalDataSource, MemWalWriter, StagedWriter, TableRef  # noqa: E402
from memwal_df.spark.staging import RegionStage, StagedJob, stage_batches, write_regions  # noqa: E402

pytestmark = pytest.mark.spark

DIM = 4
SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("category", pa.string()),
        ("value", pa.float64()),
        ("vec", pa.list_(pa.float32(), DIM)),
    ]
)
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="session")
def spark():
    session = mws.session(master="local[2,4]")
    yield session
    session.stop()


def rows(ids: Any, step: int) -> pa.Table:
    """Rows for `ids` whose values depend on `step` (so an update is visible)."""
    ids = np.asarray(ids, dtype=np.int64)
    vec = np.repeat((ids * 10 + step).astype(np.float32)[:, None], DIM, axis=1) + np.arange(
        DIM, dtype=np.float32
    )
    return pa.table(
        {
            "id": ids,
            "category": pa.array([f"c{(i + step) % 5}" for i in ids.tolist()]),
            "value": pa.array(np.where(ids % 7 == 0, np.nan, ids * 1.5 + step)).to_pylist(),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vec.ravel()), DIM),
        },
        schema=SCHEMA,
    )


def to_spark(spark, table: pa.Table):
    """A Spark DataFrame of `table` (vectors as Spark arrays, as users have them)."""
    columns = [
        c.cast(pa.list_(pa.float32())) if pa.types.is_fixed_size_list(c.type) else c for c in table.columns
    ]
    return spark.createDataFrame(pa.Table.from_arrays(columns, names=table.column_names))


def normalized(data: pa.Table | list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """Key -> row with vectors as lists of floats and NaN as a comparable marker."""
    out = {}
    for k, r in model_rows(data, ("id",)).items():
        r = dict(r)
        if r.get("vec") is not None:
            r["vec"] = [float(x) for x in r["vec"]]
        if isinstance(r.get("value"), float) and r["value"] != r["value"]:
            r["value"] = "NaN"
        out[k] = r
    return out


def spark_rows(spark, uri: str, options: dict[str, str] | None = None, where: str | None = None):
    reader = spark.read.format("memwal")
    if options:
        reader = reader.option("storage_options", json.dumps(options))
    df = reader.load(uri)
    if where is not None:
        df = df.where(where)
    return df.toArrow()


def save(df, uri: str, options: dict[str, str] | None = None, fmt: str = "memwal", **settings: Any) -> None:
    """`df.write.format(fmt).mode("append").save(uri)`, rows not routed, with data source options."""
    writer = df.write.format(fmt).mode("append")
    if options:
        writer = writer.option("storage_options", json.dumps(options))
    for key, value in settings.items():
        writer = writer.option(key, str(value))
    writer.save(uri)


# ------------------------------------------------------------------------------ ingest and read


def test_ingest_then_read_back_equals_the_model(spark, table_uri, table_storage_options):
    table = mw.create_table(
        table_uri,
        rows(range(0, 300, 3), 0),
        "id",
        region_spec=mw.bucket("id", 4),
        storage_options=table_storage_options,
    )
    model = normalized(rows(range(0, 300, 3), 0))
    first, second = rows(range(0, 2000), 1), rows(range(1000, 2500, 2), 2)
    mws.write(to_spark(spark, first), table_uri, table_storage_options)
    mws.write(to_spark(spark, second), table_uri, table_storage_options)
    dead = pa.table({"id": pa.array(list(range(0, 2500, 11)), pa.int64())})
    mws.delete(spark.createDataFrame(dead), table_uri, table_storage_options)
    for batch in (first, second):
        model.update(normalized(batch))
    for k in dead.column("id").to_pylist():
        model.pop(k, None)

    got = spark_rows(spark, table_uri, table_storage_options)
    assert got.schema.field("vec").type == pa.list_(pa.float32())
    assert got.num_rows == len(model)
    assert normalized(got) == model
    assert normalized(list(stored_rows(table).values())) == model  # the row-by-row oracle
    assert normalized(mw.MemWalTable(table_uri, table_storage_options).to_table()) == model
    regions = table.status()["regions"]
    assert len(regions) == 4 and all(r.flushed_generations for r in regions)


def test_overwrite_and_unroutable_rows_are_refused(spark, tmp_path):
    uri = str(tmp_path / "t")
    mw.create_table(uri, SCHEMA, "id", region_spec=mw.bucket("id", 4))
    df = to_spark(spark, rows(range(10), 0))
    with pytest.raises(Exception, match="only appends"):
        mws.route(df, mw.open_table(uri)).write.format("memwal").mode("overwrite").save(uri)
    with pytest.raises(Exception, match="only appends"):
        df.write.format("memwal").mode("overwrite").save(uri)
    with pytest.raises(Exception, match="ErrorIfExists"):
        df.write.format("memwal").save(uri)  # Spark's default mode, which Python data sources lack
    with pytest.raises(SchemaMismatchError):
        mws.delete(df.select("id", "category"), uri)  # not key columns only
    with pytest.raises(Exception, match="not in the primary key"):
        save(df.select("id", "category"), uri, operation="delete")
    with pytest.raises(Exception, match="lease_ttl_s"):
        save(df, uri, lease_ttl_s="soon")
    assert mw.MemWalTable(uri).to_table().num_rows == 0
    c_uri = str(tmp_path / "c")
    by_category = lance_made_table(c_uri, SCHEMA.empty_table(), "id", identity_column="category")
    with pytest.raises(RegionRoutingError, match="non-key columns"):
        mws.delete(df.select("id"), by_category)
    with pytest.raises(Exception, match="not primary-key columns"):
        save(df.select("id"), by_category.uri, operation="delete")
    with pytest.raises(NonKeyRegionColumnError, match="allow_non_key_region_columns"):
        mws.write(df, by_category)


# ------------------------------------------------------------------------------ unrouted saves


def test_unrouted_saves_of_many_partitions_equal_the_model(spark, table_uri, table_storage_options):
    base = rows(range(0, 600, 3), 0)
    options = table_storage_options
    table = mw.create_table(table_uri, base, "id", region_spec=mw.bucket("id", 4), storage_options=options)
    first, second = rows(range(0, 1500), 1), rows(range(700, 2400, 2), 2)
    dead = pa.table({"id": pa.array(range(0, 2400, 13), pa.int64())})
    # round-robin partitions: every partition holds rows of every region
    save(to_spark(spark, first).repartition(6), table_uri, options, stage_memory_bytes=50_000)  # spills
    save(to_spark(spark, second).repartition(5), table_uri, options)
    save(spark.createDataFrame(dead).repartition(3), table_uri, options, operation="delete")
    model = {**normalized(base), **normalized(first), **normalized(second)}
    for k in dead.column("id").to_pylist():
        model.pop(k, None)

    assert normalized(mw.MemWalTable(table_uri, options).to_table()) == model
    assert normalized(list(stored_rows(table).values())) == model  # the row-by-row oracle
    assert normalized(spark_rows(spark, table_uri, options)) == model
    assert table.storage.list_dir(layout.WRITE_LEASE_DIR) == []  # each commit removed its job's leases
    # one claim and one generation per task and region: tasks never fenced each other
    regions = table.status()["regions"]
    assert len(regions) == 4
    assert all(r.writer_epoch == len(r.flushed_generations) == 6 + 5 + 3 for r in regions)


def test_unrouted_puts_and_deletes_over_several_jobs(spark, tmp_path):
    """Random puts and deletes in separate jobs on an expression spec (routed in the tasks only);
    then a crashed driver's leftover leases are removed by `table.gc()`."""
    uri = str(tmp_path / "t")
    table = mw.create_table(uri, SCHEMA, "id", region_spec=mw.expression("col0 % 5", ["id"], pa.int64()))
    rng = np.random.default_rng(11)
    model: dict[Any, dict[str, Any]] = {}
    for step in range(1, 4):
        puts = rows(np.sort(rng.choice(3000, 800, replace=False)), step)
        save(to_spark(spark, puts).repartition(4), uri)
        model.update(normalized(puts))
        dead = rng.choice(3000, 300, replace=False).tolist()
        save(
            spark.createDataFrame(pa.table({"id": pa.array(dead, pa.int64())})).repartition(3),
            uri,
            operation="delete",
            durable="false",
        )
        for k in dead:
            model.pop(k, None)
        assert normalized(mw.MemWalTable(uri).to_table()) == model, step
    assert normalized(list(stored_rows(table).values())) == model
    assert {r.region_id for r in table.status()["regions"]} == {table.region_id_for((v,)) for v in range(5)}
    region = table.region_ids()[0]
    lease.acquire(table.storage, layout.write_lease_dir("crashed", region), "crashed:0", dt.timedelta(0))
    assert table.storage.list_dir(layout.WRITE_LEASE_DIR) == ["crashed"]
    assert table.gc().write_lease_jobs == ()  # expired less than the grace period ago
    assert table.gc(grace=dt.timedelta(0)).write_lease_jobs == ("crashed",)
    assert table.storage.list_dir(layout.WRITE_LEASE_DIR) == []


@pytest.fixture(scope="module")
def stage_table(tmp_path_factory) -> mw.Table:
    return mw.create_table(str(tmp_path_factory.mktemp("stage") / "t"), SCHEMA, "id", mw.bucket("id", 3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 600),
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 200),
    memory=st.sampled_from([0, 1_000, 3_000, 10_000, 1 << 30]),
    max_rows=st.integers(1, 500),
)
def test_region_stage_keeps_each_regions_rows_in_order(
    stage_table, tmp_path, n, seed, batch, memory, max_rows
):
    """Staged and read back (twice: a region is written again after a fence), each region's rows
    are the input rows routed there (row by row, as the table writer derives region ids), in input
    order, whatever spills; chunks reach `max_rows` rows but the last; `close()` removes the spill
    files."""
    ids = np.random.default_rng(seed).choice(2**40, n, replace=False) - 2**39
    table, data = stage_table, rows(ids, 0)
    values = not_none(table.spec).evaluate(data, table.schema.field_ids)
    regions = [table.region_id_for(region_of_row(values, i)) for i in range(data.num_rows)]
    spill_root = tempfile.mkdtemp(dir=tmp_path)
    with RegionStage(table.schema.schema, memory, spill_root) as stage:
        assert stage_batches(table, data.to_batches(max_chunksize=batch), "upsert", stage) == n
        assert (stage.spills > 0) == bool(os.listdir(spill_root)) and (stage.spills > 0 or memory > 0)
        assert sorted(stage.regions) == sorted(set(regions))
        for region in stage.regions:
            want = data.filter(pa.array([r == region for r in regions]))
            for _ in range(2):
                chunks = list(stage.chunks(region, max_rows))
                assert all(c.num_rows >= max_rows for c in chunks[:-1])
                got = pa.concat_tables(chunks)
                assert got.column("id").equals(want.column("id"))  # in input order
                assert normalized(got) == normalized(want)  # (NaN values: Table.equals is False)
    assert not os.listdir(spill_root)


@pytest.mark.parametrize("fenced_by", ["outside_writer", "task_after_expiry", "newer_attempt", "job_end"])
def test_a_fenced_task_writes_its_region_again_or_gives_up(tmp_path, monkeypatch, fenced_by):
    """Right after the task's WAL entry of a region, another writer claims the region (fencing the
    task) and writes rows of its own. The task claims the region again and rewrites its rows while
    the lease is still its own, or once the task that took the lease over released it; it gives up
    when a newer attempt of its partition holds the lease or the job's leases are gone."""
    table = mw.create_table(str(tmp_path / "t"), SCHEMA, "id", region_spec=mw.unsharded())
    job, storage, long = StagedJob("job", "upsert", durable=True), table.storage, dt.timedelta(minutes=10)
    mine, theirs = rows(range(0, 1000), 1), rows([5, 5000], 2)
    real_put = TableWriter.put
    fenced: list[uuid.UUID] = []

    def put(writer, data):
        real_put(writer, data)
        if fenced:
            return
        (region,) = fenced[:] = list(writer.writers)
        directory = job.lease_dir(region)
        if fenced_by == "task_after_expiry":  # another task of the job, as if the lease had expired
            taken = lease.take(storage, directory, lease.current(storage, directory), "job:1", long)
            threading.Timer(0.3, lease.release, (storage, directory, taken)).start()
        elif fenced_by == "newer_attempt":
            lease.acquire(storage, directory, "job:0", long)
        elif fenced_by == "job_end":
            lease.remove(storage, job.lease_dir())
        with table.region_writer(region) as w:
            w.put(theirs)

    monkeypatch.setattr(TableWriter, "put", put)
    with RegionStage(table.schema.schema, 1 << 30) as stage:
        stage_batches(table, mine.to_batches(), "upsert", stage)
        if fenced_by in ("newer_attempt", "job_end"):
            with pytest.raises(WriterFencedError):
                write_regions(table, stage, job, "job:0")
            want = {**normalized(mine), **normalized(theirs)}  # the claim replayed the task's entry
        else:
            assert write_regions(table, stage, job, "job:0") == {fenced[0]: 3}  # ours, theirs, ours
            want = {**normalized(theirs), **normalized(mine)}  # written again after theirs
    assert normalized(mw.MemWalTable(table).to_table()) == want


# ------------------------------------------------------------------------------ routing


def routing_data(n: int = 3000) -> pa.Table:
    rng = np.random.default_rng(7)
    ids = np.concatenate(
        [
            rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64),
            [0, -1, 1, 2**63 - 1, -(2**63), 2**31, -(2**31)],
        ]
    )
    m = len(ids)
    small = rng.integers(-(2**31), 2**31 - 1, m).astype(np.int32)
    ts = rng.integers(0, 4_000_000_000_000_000, m)  # microseconds, 1970..2096
    return pa.table(
        {
            "id": ids,
            "i32": pa.array(small, mask=rng.random(m) < 0.1),
            "i16": pa.array(rng.integers(-(2**15), 2**15 - 1, m).astype(np.int16)),
            "flag": pa.array(rng.random(m) < 0.5),
            "day": pa.array(rng.integers(-20000, 40000, m).astype(np.int32)).cast(pa.date32()),
            "name": pa.array([f"näme-{x % 997}-{'x' * int(x % 13)}" for x in small.tolist()]),
            "ts": pa.array(ts, pa.timestamp("us")),
        }
    )


SPECS = {
    "bucket_int64": mw.bucket("id", 16),
    "bucket_int32_nulls": mw.bucket("i32", 7),
    "bucket_int16": mw.bucket("i16", 5),
    "bucket_bool": mw.bucket("flag", 3),
    "bucket_date": mw.bucket("day", 11),
    "multi_bucket": mw.multi_bucket(["i32", "id"], 13),
    "bucket_string": mw.bucket("name", 9),
    "identity": mw.identity("i16"),
    "truncate": mw.truncate("name", 6),
    "year": mw.year("ts"),
    "month": mw.month("ts"),
    "day_of_month": mw.day("ts"),
    "hour": mw.hour("ts"),
    "expression": mw.expression("col0 % 10", ["id"], pa.int64()),
    "two_fields": mw.bucket("id", 4, field_id="b") + mw.identity("flag", field_id="f"),
    "unsharded": mw.unsharded(),
}


def test_spark_routing_equals_the_writers_routing(spark, tmp_path):
    data = routing_data()
    df = spark.createDataFrame(data)
    for name, spec in SPECS.items():  # specs over any column: routing, not the key rule, is tested here
        table = foreign_spec_table(str(tmp_path / name), data.schema.empty_table(), "id", spec)
        routed = mws.route(df, table).select("id", mws.ROUTE).toArrow()
        by_id = dict(zip(routed.column("id").to_pylist(), routed.column(mws.ROUTE).to_pylist(), strict=True))
        assert len(by_id) == data.num_rows, name
        values = not_none(table.spec).evaluate(data, table.schema.field_ids)
        python_regions = [table.region_id_for(region_of_row(values, i)) for i in range(data.num_rows)]
        spark_routes = [by_id[k] for k in data.column("id").to_pylist()]
        # the same region <=> the same route value: one task gets all rows of a region
        pairs = set(zip(spark_routes, python_regions, strict=True))
        assert len({r for r, _ in pairs}) == len(pairs) == len({p for _, p in pairs}), name
        if name.startswith(("bucket_", "multi_bucket")) and name != "bucket_string":
            assert spark_routes == values[0].to_pylist(), name  # computed as a Spark expression
        elif name != "unsharded":
            assert spark_routes == [str(r) for r in python_regions], name  # mapInArrow


# ------------------------------------------------------------------------------ concurrency


def test_memwaltable_reads_during_a_spark_ingest_see_whole_regions(spark, tmp_path):
    uri = str(tmp_path / "t")
    table = mw.create_table(uri, rows(range(3000), 0), "id", region_spec=mw.bucket("id", 4))
    old, new = normalized(rows(range(3000), 0)), normalized(rows(range(0, 6000, 2), 1))
    after = {**old, **new}
    region_of = {}
    keys = pa.table({"id": pa.array(list(after), pa.int64())})
    for k, v in zip(
        after, not_none(table.spec).evaluate(keys, table.schema.field_ids)[0].to_pylist(), strict=True
    ):
        region_of[k] = v
    stop, reads, errors = threading.Event(), [], []

    def reader() -> None:
        reader_table = mw.MemWalTable(uri)
        while not stop.wait(0.05):
            try:
                reads.append(normalized(reader_table.to_table()))
            except Exception as e:  # reported below
                errors.append(e)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        mws.write(to_spark(spark, rows(range(0, 6000, 2), 1)), uri)
    finally:
        stop.set()
        thread.join()
    assert not errors
    reads.append(normalized(mw.MemWalTable(uri).to_table()))
    assert reads[-1] == after
    for seen in reads:
        for region in range(4):  # each region is flushed once, at its task's end: all old or all new
            part = {k: r for k, r in seen.items() if region_of[k] == region}
            want_old = {k: r for k, r in old.items() if region_of[k] == region}
            want_new = {k: r for k, r in after.items() if region_of[k] == region}
            assert part in (want_old, want_new)


# ------------------------------------------------------------------------------ merge


def write_history(table: mw.Table) -> None:
    with table.writer() as w:
        for step in range(1, 4):
            w.put(rows(range(step * 100, step * 100 + 400), step))
            w.delete(pa.table({"id": pa.array(list(range(step * 50, step * 50 + 40)), pa.int64())}))
            w.flush()


def test_spark_merge_equals_table_merge(spark, tmp_path):
    tables = [
        mw.create_table(str(tmp_path / n), rows(range(0, 500, 2), 0), "id", region_spec=mw.bucket("id", 4))
        for n in ("spark", "python")
    ]
    for t in tables:
        write_history(t)
    before = normalized(mw.MemWalTable(tables[0]).to_table())
    by_spark = mws.merge(spark, tables[0].uri)
    by_python = tables[1].merge()

    def summary(result):
        return {(r.region_id, r.generations, r.rows_upserted, r.rows_deleted) for r in result.regions}

    assert summary(by_spark) == summary(by_python)
    assert all(r.generations == (1, 2, 3) for r in by_spark.regions)
    for t in tables:
        t.refresh()
        assert normalized(t.dataset.to_table()) == before  # everything merged into the base
        assert normalized(mw.MemWalTable(t).to_table()) == before
    assert mws.merge(spark, tables[0].uri).generations == {}  # nothing left: a no-op


# ------------------------------------------------------------------------------ failures


def die_once(marker: str) -> Callable[[], None]:
    """A function that exits its Python worker (kills the task) unless a task did so before (`marker`
    exists). A closure, so that Spark's workers get it by value (they cannot import this module)."""

    def die() -> None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        os._exit(1)

    return die


def kill_once_table(tmp_path, buckets: int) -> tuple[mw.Table, str, Callable[[], None]]:
    """A table of rows 0-99 (version 0) in `buckets` bucket regions, the marker file of `die_once`
    and that function."""
    table = mw.create_table(
        str(tmp_path / "t"), rows(range(100), 0), "id", region_spec=mw.bucket("id", buckets)
    )
    marker = str(tmp_path / "killed")
    return table, marker, die_once(marker)


def assert_survived_the_kill(table: mw.Table, marker: str, data: pa.Table) -> None:
    """A task was killed (`marker` exists) and the table holds rows 0-99 upserted with `data`, as
    read through MemWalTable and as stored."""
    assert os.path.exists(marker)
    model = {**normalized(rows(range(100), 0)), **normalized(data)}
    assert normalized(mw.MemWalTable(table.uri).to_table()) == model
    assert normalized(list(stored_rows(table).values())) == model


def register_writer(spark, name: str, make_writer: Any) -> str:
    """Register a "memwal" data source named `name` whose writer is `make_writer(ref, schema, options)`."""

    class Source(MemWalDataSource):
        @classmethod
        def name(cls):
            return name

        def writer(self, schema, overwrite):
            return make_writer(TableRef.from_options(self.options), schema, self.options)

    spark.dataSource.register(Source)
    return name


def test_a_task_killed_mid_write_leaves_the_table_correct(spark, tmp_path):
    table, marker, die = kill_once_table(tmp_path, 2)

    class KilledOnce(MemWalWriter):
        def write(self, iterator):
            def batches():
                for i, batch in enumerate(iterator):
                    if i == 1:  # batch 0 is in the WAL (durable put): die while writing
                        die()
                    yield batch

            return super().write(batches())

    source = register_writer(spark, "memwal_killed_once", lambda ref, _, options: KilledOnce(ref, options))
    data = rows(range(50, 4050), 1)
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "200")
    try:
        routed = mws.route(to_spark(spark, data), table)
        routed.write.format(source).mode("append").save(table.uri)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert_survived_the_kill(table, marker, data)
    # the killed attempt claimed a region (epoch 1) and wrote to its WAL; the retry fenced it
    retried = [r for r in table.status()["regions"] if r.writer_epoch >= 2]
    assert retried
    entries = [e for r in retried for e in Wal(table.storage, r.region_id).scan(1)]
    assert any(e.writer_epoch == 1 and not e.is_sentinel and e.num_rows for e in entries)


def test_a_task_killed_mid_unrouted_write_leaves_the_table_correct(spark, tmp_path):
    """The first task to write a region dies after its rows are in the WAL, holding the region's
    lease; its retry takes the lease over, claims the region (replaying them) and writes it again."""
    table, marker, die = kill_once_table(tmp_path, 3)

    class KilledInRegion(StagedWriter):
        def write(self, iterator):
            real = TableWriter.put

            def put(writer, data):
                real(writer, data)  # durable: in the WAL, not flushed
                die()

            with mock.patch.object(TableWriter, "put", put):
                return super().write(iterator)

    source = register_writer(spark, "memwal_unrouted_killed_once", KilledInRegion)
    data = rows(range(50, 4050), 1)
    save(to_spark(spark, data).repartition(4), table.uri, fmt=source, lease_ttl_s=10)
    assert_survived_the_kill(table, marker, data)
    assert table.storage.list_dir(layout.WRITE_LEASE_DIR) == []
    # 4 tasks x 3 regions claims, each flushed once, and the killed attempt's claim, never flushed
    regions = table.status()["regions"]
    assert sum(r.writer_epoch for r in regions) == 4 * 3 + 1
    assert sum(len(r.flushed_generations) for r in regions) == 4 * 3


# ------------------------------------------------------------------------------ filters and pruning


def test_filters_are_exact_after_dedup_and_prune_regions(spark, tmp_path):
    uri = str(tmp_path / "t")
    base = rows(range(1000), 0)
    table = mw.create_table(uri, base, "id", region_spec=mw.bucket("id", 4))
    newer = rows(range(0, 1000, 3), 1)  # categories shift by one: the base's match is stale
    with table.writer() as w:
        w.put(newer)
        w.delete(pa.table({"id": pa.array(list(range(0, 1000, 10)), pa.int64())}))
    model = {**normalized(base), **normalized(newer)}
    for k in range(0, 1000, 10):
        model.pop(k, None)
    checks = {
        "category = 'c1'": lambda r: r["category"] == "c1",
        "id = 5": lambda r: r["id"] == 5,
        "id IN (3, 4, 5, 10, 999)": lambda r: r["id"] in (3, 4, 5, 10, 999),
        "id >= 500 AND category <> 'c2'": lambda r: r["id"] >= 500 and r["category"] != "c2",
        "NOT (id < 900)": lambda r: not r["id"] < 900,
        "category IS NULL": lambda r: r["category"] is None,
        # left to Spark, with Spark's semantics: NaN is above every number, and NaN = NaN
        "value > 100.0": lambda r: r["value"] == "NaN" or r["value"] > 100.0,
        "value = 'NaN'": lambda r: r["value"] == "NaN",
    }
    for where, keep in checks.items():
        want = {k: r for k, r in model.items() if keep(r)}
        assert normalized(spark_rows(spark, uri, where=where)) == want, where
    full = spark.read.format("memwal").option("base_partitions", "1").load(uri)
    point = full.where("id = 5")
    assert full.rdd.getNumPartitions() == 4 + 1  # a partition per region with levels, one base span
    assert point.rdd.getNumPartitions() == 1 + 1  # the other three regions are pruned


# ------------------------------------------------------------------------------ example


def test_the_spark_example_runs_and_checks_itself(spark, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("spark_ingest", EXAMPLES / "spark_ingest.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(str(tmp_path / "events"), spark) == 0
    assert "read-back equals the model: OK" in capsys.readouterr().out


def test_dates_and_timestamps_round_trip(spark, tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema([("id", pa.int32()), ("d", pa.date32()), ("ts", pa.timestamp("us"))])
    foreign_spec_table(uri, schema.empty_table(), "id", mw.day("d"))  # routed by a non-key date
    data = pa.table(
        {
            "id": pa.array([1, 2, 3], pa.int32()),
            "d": pa.array([dt.date(2024, 1, 31), dt.date(1969, 12, 31), None]),
            "ts": pa.array([dt.datetime(2024, 1, 31, 23, 59, 59, 999999), None, dt.datetime(1970, 1, 1)]),
        }
    ).cast(schema)
    mws.write(spark.createDataFrame(data), uri, allow_non_key_region_columns=True)
    want = data.to_pylist()
    assert mw.MemWalTable(uri).to_table().sort_by("id").to_pylist() == want
    assert spark_rows(spark, uri).sort_by("id").to_pylist() == want  # the session's time zone is not applied


def test_only_filters_with_the_same_meaning_in_arrow_are_pushed():
    from pyspark.sql.datasource import EqualTo, GreaterThan, In, IsNull, LessThan, Not, StringStartsWith

    from memwal_df.spark.filters import to_expression

    schema = pa.schema([("id", pa.int32()), ("s", pa.string()), ("f", pa.float64()), ("d", pa.date32())])
    data = pa.table(
        {
            "id": pa.array([1, 2, None, 2**31 - 1], pa.int32()),
            "s": ["a", None, "b", "a"],
            "f": [1.0, float("nan"), 0.5, None],
            "d": [dt.date(2020, 1, 1), None, dt.date(1960, 5, 5), dt.date(2020, 1, 2)],
        }
    )
    pushed = {
        EqualTo(("s",), "a"): [1, 2**31 - 1],
        GreaterThan(("id",), 1): [2, 2**31 - 1],
        Not(LessThan(("d",), dt.date(2020, 1, 2))): [2**31 - 1],
        In(("id",), (2, 7)): [2],
        IsNull(("s",)): [2],
    }
    for f, ids in pushed.items():
        expression = to_expression(f, schema)
        assert expression is not None, f
        assert data.filter(expression).column("id").to_pylist() == ids, f
    left_to_spark = [
        EqualTo(("f",), 1.0),  # NaN semantics differ
        EqualTo(("id",), 2**40),  # does not fit the column
        EqualTo(("id",), "1"),  # another type
        In(("id",), (1, None)),
        StringStartsWith(("s",), "a"),
        EqualTo(("missing",), 1),
        Not(EqualTo(("f",), 1.0)),
    ]
    assert all(to_expression(f, schema) is None for f in left_to_spark)
