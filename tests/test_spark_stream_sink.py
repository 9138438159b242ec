"""The streaming sink (`df.writeStream.format("memwal")`, `memwal_df.spark.stream_sink`) on one local
Spark session that retries failed tasks: file streams of upserts and deletes checked against a dict
model after every micro-batch (and by a `MemWalTable` reader in another process), a task failing
once, a restarted query re-running a batch the table had committed, two queries into one table, and
bad input refused with typed errors. Run with `make test-spark` (`pytest -m spark`)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.reference import stored_rows

import memwal_df as mw
from memwal_df.format import layout, stream_commits

pytest.importorskip("pyspark")

from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    DoubleType,
    StructType,
)
from support.stream_child import EVENTS  # noqa: E402

from memwal_df import spark as mws  # noqa: E402

pytestmark = pytest.mark.spark

TABLE = pa.schema([("id", pa.int64()), ("category", pa.string()), ("value", pa.float64())])
INPUT = EVENTS  # the columns of the streams the tests write: the table's, `deleted`, `seq`
ROOT = pathlib.Path(mw.__file__).resolve().parent.parent
Model = dict[int, dict[str, Any]]


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = mws.session(master="local[2,4]")  # a failed task is retried, as on a cluster
    yield session
    session.stop()


def events(rng: np.random.Generator, n: int, keys: int, step: int, parity: int | None = None) -> pa.Table:
    """`n` change events over `keys` keys (of one parity if given): upserts and some deletes, with
    repeated keys and a `seq` column shuffled against the rows' order."""
    ids = rng.integers(0, keys, n) if parity is None else 2 * rng.integers(0, keys // 2, n) + parity
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "category": pa.array([f"s{step}-{i % 3}" for i in range(n)]),
            "value": pa.array(rng.normal(size=n)),
            "deleted": pa.array(rng.random(n) < 0.2),
            "seq": pa.array(rng.permutation(n) + step * n, pa.int64()),
        }
    )


def publish(batch: pa.Table, path: pathlib.Path) -> None:
    """Write `batch` to `path` atomically: a running query never lists a half-written file (Spark's
    file source skips names starting with a dot). Spark takes new files in modification-time order,
    counted in milliseconds, so each file gets a time at least one millisecond after the one before:
    files published back to back are read in the order they were published."""
    hidden = path.with_name(f".{path.name}")
    pq.write_table(batch, hidden)
    before = max((p.stat().st_mtime_ns // 1_000_000 for p in path.parent.glob("[!.]*")), default=0)
    ms = max(time.time_ns() // 1_000_000, before + 1)
    os.utime(hidden, ns=(ms * 1_000_000, ms * 1_000_000))
    hidden.rename(path)


def apply(model: Model, batch: pa.Table) -> None:
    """The sink's contract for one micro-batch of one partition: per key the greatest `seq` wins."""
    for row in sorted(batch.to_pylist(), key=lambda r: r["seq"]):
        if row["deleted"]:
            model.pop(row["id"], None)
        else:
            model[row["id"]] = {c: row[c] for c in TABLE.names}


def stored(uri: str) -> Model:
    return {k: dict(r) for k, r in stored_rows(mw.open_table(uri)).items()}


def read_in_other_process(uri: str) -> Model:
    """The rows a `MemWalTable(uri)` in a new Python process reads."""
    code = (
        "import json, sys; import memwal_df as mw; "
        "print(json.dumps(mw.MemWalTable(sys.argv[1]).to_table().to_pylist()))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    return {r["id"]: r for r in json.loads(run.stdout.strip().splitlines()[-1])}


def stream(spark: Any, source: pathlib.Path, uri: str, checkpoint: pathlib.Path, **options: str) -> Any:
    """A writer of the parquet files in `source` (one file per micro-batch) into table `uri`."""
    df = spark.readStream.schema(INPUT).option("maxFilesPerTrigger", 1).parquet(str(source))
    writer = df.writeStream.format("memwal").option("checkpointLocation", str(checkpoint))
    for key, value in {"delete_column": "deleted", "order_by": "seq", **options}.items():
        writer = writer.option(key, value)
    return writer


def new_table(tmp_path: pathlib.Path) -> str:
    uri = str(tmp_path / "t")
    mw.create_table(uri, TABLE, "id", region_spec=mw.bucket("id", 4))
    return uri


def test_micro_batches_equal_the_model_after_every_batch(spark, tmp_path):
    """A processing-time query: upserts and deletes, repeated keys ordered by `seq`; after each
    batch the table, a reader in another process and the commit record agree with the model."""
    uri, source = new_table(tmp_path), tmp_path / "in"
    source.mkdir()
    query = stream(spark, source, uri, tmp_path / "ckpt").trigger(processingTime="0 seconds").start(uri)
    rng = np.random.default_rng(5)
    model: Model = {}
    try:
        for step in range(4):
            batch = events(rng, 400, 300, step)
            publish(batch, source / f"{step}.parquet")
            query.processAllAvailable()
            apply(model, batch)
            assert stored(uri) == model
            assert read_in_other_process(uri) == model
            assert stream_commits.batches(mw.open_table(uri).storage, query.id) == list(range(step + 1))
    finally:
        query.stop()


def test_a_task_that_fails_once_is_retried_without_loss(spark, tmp_path):
    uri, source = new_table(tmp_path), tmp_path / "in"
    source.mkdir()
    marker = tmp_path / "failed-once"

    @F.udf(DoubleType())
    def fail_once(value: float) -> float:
        if value > 0 and not marker.exists():
            marker.touch()
            raise RuntimeError("injected task failure")
        return value

    rng = np.random.default_rng(7)

    model: Model = {}
    for step in range(2):
        batch = events(rng, 300, 200, step)
        publish(batch, source / f"{step}.parquet")
        apply(model, batch)
    df = spark.readStream.schema(INPUT).option("maxFilesPerTrigger", 1).parquet(str(source))
    query = (
        df.withColumn("value", fail_once("value"))
        .writeStream.format("memwal")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .option("delete_column", "deleted")
        .option("order_by", "seq")
        .trigger(availableNow=True)
        .start(uri)
    )
    query.awaitTermination()
    assert marker.exists()
    assert stored(uri) == model
    assert stream_commits.batches(mw.open_table(uri).storage, query.id) == [0, 1]


def test_a_restarted_query_skips_the_batch_the_table_committed(spark, tmp_path):
    """The driver committed batch 1 to the table but Spark did not log it (its `commits/1` is
    gone): the restarted query runs batch 1 again, and the sink skips it, so a newer write of one of
    its keys by another writer survives."""
    uri, source, checkpoint = new_table(tmp_path), tmp_path / "in", tmp_path / "ckpt"
    source.mkdir()
    rng = np.random.default_rng(9)
    model: Model = {}
    for step in range(2):
        batch = events(rng, 300, 200, step)
        publish(batch, source / f"{step}.parquet")
        apply(model, batch)
    first = stream(spark, source, uri, checkpoint).trigger(availableNow=True).start(uri)
    first.awaitTermination()
    assert stored(uri) == model
    for name in ("1", ".1.crc"):
        (checkpoint / "commits" / name).unlink()
    key = next(iter(model))
    newer = {"id": key, "category": "newer", "value": -1.0}
    with mw.open_table(uri).writer() as writer:
        writer.put(pa.Table.from_pylist([newer], schema=TABLE))
    model[key] = newer

    again = stream(spark, source, uri, checkpoint).trigger(availableNow=True).start(uri)
    again.awaitTermination()
    assert again.id == first.id
    assert [p["batchId"] for p in again.recentProgress] == [1]  # Spark did run batch 1 again
    assert again.recentProgress[0]["numInputRows"] == 300
    assert stored(uri) == model

    # A batch that did not commit (the driver died before the sink's commit) is written again: the
    # table ends as a clean run would, the other writer's newer row overwritten (at-least-once).
    for name in ("1", ".1.crc"):
        (checkpoint / "commits" / name).unlink()
    storage = mw.open_table(uri).storage
    storage.delete(f"{layout.stream_dir(first.id)}/{1:020d}.json")
    third = stream(spark, source, uri, checkpoint).trigger(availableNow=True).start(uri)
    third.awaitTermination()
    assert [p["batchId"] for p in third.recentProgress] == [1]
    clean: Model = {}
    for step in range(2):
        apply(clean, pq.read_table(source / f"{step}.parquet"))
    assert stored(uri) == clean
    assert stream_commits.batches(storage, first.id) == [0, 1]


def test_two_queries_into_one_table(spark, tmp_path):
    """Two queries write disjoint keys (even / odd ids) of the same regions at the same time."""
    uri = new_table(tmp_path)
    sources = [tmp_path / "even", tmp_path / "odd"]
    queries = []
    rng = np.random.default_rng(3)
    model: Model = {}
    for parity, source in enumerate(sources):
        source.mkdir()
        sink = stream(spark, source, uri, tmp_path / f"ckpt{parity}", lease_ttl_s="10")
        queries.append(sink.trigger(processingTime="0 seconds").start(uri))
    try:
        for step in range(2):
            for parity, source in enumerate(sources):
                batch = events(rng, 300, 400, step, parity)
                publish(batch, source / f"{step}.parquet")
                apply(model, batch)
            for query in queries:
                query.processAllAvailable()
            assert stored(uri) == model
    finally:
        for query in queries:
            query.stop()
    table = mw.open_table(uri)
    assert [stream_commits.batches(table.storage, q.id) for q in queries] == [[0, 1], [0, 1]]
    assert table.storage.list_dir(f"{layout.WRITE_LEASE_DIR}/streams") != []  # the shared region leases
    # one claim per generation: the queries' tasks took turns on regions, none was fenced
    assert all(r.writer_epoch == len(r.flushed_generations) for r in table.status()["regions"])


def failure(query: Any) -> str:
    with pytest.raises(Exception) as caught:
        query.awaitTermination()
    return str(caught.value)


def test_bad_input_is_refused_with_typed_errors(spark, tmp_path):
    uri, source = new_table(tmp_path), tmp_path / "in"
    source.mkdir()
    batch = events(np.random.default_rng(1), 50, 40, 0)
    bad_flag = batch.set_column(3, "deleted", pa.array([None] * 50, pa.bool_()))
    publish(bad_flag, source / "0.parquet")
    query = stream(spark, source, uri, tmp_path / "c1").trigger(availableNow=True).start(uri)
    assert "NullDeleteFlagError" in failure(query)
    query = stream(spark, source, uri, tmp_path / "c2", delete_column="").start(uri)
    assert "SchemaMismatchError" in failure(query)  # `deleted` is then a column the table lacks
    df = spark.readStream.schema(INPUT).parquet(str(source)).drop("category", "deleted", "seq")
    query = df.writeStream.format("memwal").option("checkpointLocation", str(tmp_path / "c3")).start(uri)
    assert "MissingColumnsError" in failure(query)
    counts = spark.readStream.schema(INPUT).parquet(str(source)).groupBy("id").count()
    query = counts.writeStream.format("memwal").outputMode("complete")
    query = query.option("checkpointLocation", str(tmp_path / "c4")).start(uri)
    assert "only upserts" in failure(query)  # complete mode asks the sink to overwrite
    assert stored(uri) == {}


def test_the_streaming_example_runs_and_checks_itself(spark, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("spark_streaming", ROOT / "examples" / "spark_streaming.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(str(tmp_path / "stream"), spark) == 0
    assert "table == mirror == model: OK" in capsys.readouterr().out


def test_a_partial_stream_updates_only_the_columns_it_carries(spark, tmp_path):
    """`partial`: a stream of (`id`, `value`) events updates `value` only; `category` keeps each key's
    current value, is NULL for new keys, and a key deleted then updated in one batch is new again."""
    uri, source = new_table(tmp_path), tmp_path / "in"
    source.mkdir()
    first = pa.table(
        {"id": pa.array(range(0, 300, 2), pa.int64()), "category": [f"c{i}" for i in range(150)]}
    )
    first = first.append_column("value", pa.array(np.zeros(150)))
    with mw.open_table(uri).writer() as w:
        w.put(first)
    model: Model = {r["id"]: r for r in first.to_pylist()}
    schema = StructType([f for f in INPUT.fields if f.name != "category"])
    df = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(source))
    query = (
        df.writeStream.format("memwal")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .option("partial", "true")
        .option("delete_column", "deleted")
        .option("order_by", "seq")
        .trigger(availableNow=True)
    )
    rng = np.random.default_rng(9)
    for step in range(2):
        batch = events(rng, 300, 300, step).drop_columns(["category"])
        publish(batch, source / f"{step}.parquet")
        query.start(uri).awaitTermination(120)
        for row in sorted(batch.to_pylist(), key=lambda r: r["seq"]):
            if row["deleted"]:
                model.pop(row["id"], None)
            else:
                model[row["id"]] = {
                    "id": row["id"],
                    "category": None,
                    **model.get(row["id"], {}),
                    "value": row["value"],
                }
        assert stored(uri) == model


def test_a_driver_killed_mid_batch_restarts_from_its_checkpoint_without_loss(tmp_path):
    """The driver process (and its JVM) SIGKILLed while a micro-batch is being written (some regions
    flushed, the batch not recorded): a new driver from the same checkpoint writes that batch again
    and the rest, and the table equals the model of every file applied in order."""
    uri, inbox, ckpt = new_table(tmp_path), tmp_path / "in", tmp_path / "ckpt"
    inbox.mkdir()
    child = ROOT / "tests" / "support" / "stream_child.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rng = np.random.default_rng(17)
    model: Model = {}
    files = [events(rng, 2_000, 1_500, step) for step in range(4)]
    for batch in files:
        apply(model, batch)
    publish(files[0], inbox / "0.parquet")
    run = subprocess.Popen(
        [sys.executable, str(child), "run", uri, str(inbox), str(ckpt)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its JVM too
    )
    try:
        assert run.stdout is not None
        query = run.stdout.readline().split()[-1]
        storage = mw.open_table(uri).storage
        deadline = time.monotonic() + 120
        while stream_commits.batches(storage, query) != [0]:  # the first file committed
            assert time.monotonic() < deadline and run.poll() is None
            time.sleep(0.05)
        flushed = generations(uri)
        publish(files[1], inbox / "1.parquet")
        while generations(uri) == flushed:  # a region of the second file flushed
            assert time.monotonic() < deadline and run.poll() is None
            time.sleep(0.005)
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        assert stream_commits.batches(storage, query) == [0]  # killed before the batch committed
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    for step in (2, 3):
        publish(files[step], inbox / f"{step}.parquet")
    drain = subprocess.run(
        [sys.executable, str(child), "drain", uri, str(inbox), str(ckpt)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert drain.returncode == 0, drain.stderr[-3000:]
    assert drain.stdout.split()[-1] == query  # the same query, restarted
    assert stream_commits.batches(mw.open_table(uri).storage, query)[-1] == 3
    assert stored(uri) == model


def generations(uri: str) -> int:
    """How many generations the table's regions have flushed."""
    table = mw.open_table(uri)
    return sum(len(s.flushed_generations) for rid in table.region_ids() if (s := table.region_status(rid)))
