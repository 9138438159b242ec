"""The change feed in Spark (`memwal_df.spark.change_feed`), on one local session: a streaming
query replays the feed into a second table that ends equal to the first, across restarts from its
checkpoint (availableNow, a micro-batch that failed before its sink applied it, a processing-time
trigger with writes while it runs, generation limits per trigger) with every change applied exactly
once; a registered consumer's offsets follow the query;
batch reads with `changes_since` / `changes_until`; `startingOffsets` = latest. Run with
`make test-spark` (`pytest -m spark`)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pyarrow as pa
import pytest
from support.jobs import Workload, cleanup, create
from support.reference import stored_rows

import memwal_df as mw
from memwal_df.errors import ChangesExpiredError
from memwal_df.read.changes import net_changes

pytest.importorskip("pyspark")

from pyspark.errors import StreamingQueryException  # noqa: E402

from memwal_df import spark as mws  # noqa: E402

pytestmark = pytest.mark.spark

BASE = 40
ORDER = [("_region", "ascending"), ("_generation", "ascending"), ("_position", "ascending")]
CHANGE = ["_region", "_generation", "_position"]


@pytest.fixture(scope="session")
def spark():
    session = mws.session(master="local[2,4]")
    yield session
    session.stop()


def identities(changes: pa.Table) -> list[tuple[Any, ...]]:
    return [tuple(r.values()) for r in changes.sort_by(ORDER).select(CHANGE).to_pylist()]


def apply_changes(target: mw.Table, changes: pa.Table) -> None:
    """Apply a micro-batch of changes to `target`."""
    upserts, deletes = net_changes(changes, ["id"])
    with target.writer() as w:
        w.put(upserts)
        w.delete(deletes)


def generations(table: mw.Table, work: Workload, count: int) -> None:
    with table.writer() as w:
        for _ in range(count):
            work.write(w, puts=12, deletes=4)
            w.flush()


def test_a_stream_replays_the_feed_into_a_second_table_across_restarts(spark, tmp_path):
    source = create(str(tmp_path / "source"), None, regions=2, base=BASE)
    replica = create(str(tmp_path / "replica"), None, regions=2, base=BASE)
    work = Workload(source, seed=7, base=BASE)
    generations(source, work, 2)
    seen: list[tuple[Any, ...]] = []
    fail_next = [False]

    def each_batch(df: Any, batch_id: int) -> None:
        if fail_next[0]:
            fail_next[0] = False
            raise RuntimeError("the sink failed before applying the micro-batch")
        changes = df.toArrow()
        seen.extend(identities(changes))
        apply_changes(replica, changes)

    def query(trigger: dict[str, Any], **options: str) -> Any:
        reader = spark.readStream.format("memwal").option("consumer_id", "replica")
        for key, value in options.items():
            reader = reader.option(key, value)
        stream = reader.load(source.uri).writeStream.foreachBatch(each_batch)
        return stream.option("checkpointLocation", str(tmp_path / "ckpt")).trigger(**trigger).start()

    def check() -> None:
        assert stored_rows(replica) == stored_rows(source) == work.model
        assert len(seen) == len(set(seen))  # no change twice
        assert sorted(seen) == identities(source.changes("earliest").read_all())  # none skipped
        consumer = [c for c in source.consumers() if c.consumer_id == "replica"]
        assert consumer and consumer[0].offsets == source.changes("latest").start

    query({"availableNow": True}, startingOffsets="earliest").awaitTermination()
    check()

    generations(source, work, 1)
    fail_next[0] = True  # the micro-batch is planned (in the checkpoint), never committed
    with pytest.raises(StreamingQueryException):
        query({"availableNow": True}).awaitTermination()
    generations(source, work, 1)  # written between runs: the restart re-runs the failed batch, then these
    running = query({"processingTime": "500 milliseconds"})
    running.processAllAvailable()
    generations(source, work, 2)  # written while the query runs
    running.processAllAvailable()
    running.stop()
    check()

    generations(source, work, 3)
    before = len(seen)
    limited = query({"availableNow": True}, maxGenerationsPerTrigger="1")
    limited.awaitTermination()
    check()
    batches = [p for p in limited.recentProgress if p.numInputRows]
    assert len(batches) == 6 and sum(p.numInputRows for p in batches) == len(seen) - before


def test_batch_reads_of_the_feed_and_latest_streams(spark, tmp_path):
    table = create(str(tmp_path / "t"), None, regions=2, base=BASE)
    work = Workload(table, seed=11, base=BASE)
    generations(table, work, 3)
    full = table.changes().read_all()
    latest = table.changes("latest").start

    def batch(**options: str) -> pa.Table:
        reader = spark.read.format("memwal")
        for key, value in options.items():
            reader = reader.option(key, value)
        return reader.load(table.uri).toArrow()

    got = batch(changes_since="earliest")
    assert got.schema.names == full.schema.names
    assert got.sort_by(ORDER).equals(full.sort_by(ORDER))
    middle = table.changes(max_generations=3)
    head = middle.read_all()
    cut = middle.offsets.to_json()
    assert identities(batch(changes_since="earliest", changes_until=cut)) == identities(head)
    rest = batch(changes_since=cut)
    assert sorted(identities(head) + identities(rest)) == identities(full)
    assert batch(changes_since="latest").num_rows == 0
    assert batch().schema.names == ["id", "v"]  # no change option: the table's rows

    seen: list[tuple[Any, ...]] = []
    stream = (
        spark.readStream.format("memwal")
        .option("startingOffsets", "latest")
        .load(table.uri)
        .writeStream.foreachBatch(lambda df, _: seen.extend(identities(df.toArrow())))
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="500 milliseconds")
        .start()
    )
    stream.processAllAvailable()
    assert seen == []  # started at the latest change
    generations(table, work, 1)
    stream.processAllAvailable()
    stream.stop()
    assert sorted(seen) == identities(table.changes(latest).read_all()) != []

    plain = spark.readStream.format("memwal").load(table.uri).writeStream.format("noop")
    with pytest.raises(Exception, match="reads the change feed"):  # no change option: refused
        plain.option("checkpointLocation", str(tmp_path / "plain")).start().awaitTermination(60)

    table.merge()
    cleanup(table)
    table.gc(grace=timedelta(0))
    with pytest.raises(Exception, match=ChangesExpiredError.__name__):
        batch(changes_since=json.dumps({}))
