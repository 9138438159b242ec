"""Region writer and routed table writer: writes, deletes, flushes, replay, fencing, bad input."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import lance
import pyarrow as pa
import pytest
from support.optional import not_none
from support.reference import stored_rows

import memwal_df as mw
from memwal_df import errors
from memwal_df.format import layout
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.format.wal import Wal

SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string()), pa.field("v", pa.float64())]
)


def rows(ids, tag="a"):
    return pa.table(
        {"id": pa.array(ids, pa.int64()), "name": [f"{tag}{i}" for i in ids], "v": [float(i) for i in ids]},
        schema=SCHEMA,
    )


def expected(*tables, deleted=()):
    model = {}
    for t in tables:
        for r in t.to_pylist():
            model[r["id"]] = r
    for k in deleted:
        model.pop(k, None)
    return model


@pytest.fixture
def table(table_uri, table_storage_options):
    return mw.create_table(
        table_uri,
        rows([1, 2, 3], "base"),
        "id",
        region_spec=mw.bucket("id", 4),
        storage_options=table_storage_options,
    )


@pytest.fixture
def manual_table(table_uri, table_storage_options):
    """A table without a region spec: its regions are created by hand, under any region id."""
    return mw.create_table(table_uri, rows([1, 2, 3], "base"), "id", storage_options=table_storage_options)


def test_put_delete_flush_roundtrip(table):
    a, b = rows(range(0, 40)), rows(range(20, 60), "b")
    with table.writer() as w:
        w.put(a)
        w.put(b)
        w.delete([5, 25, 2])
    got = stored_rows(table)
    assert got == expected(rows([1, 2, 3], "base"), a, b, deleted=[5, 25, 2])
    regions = table.status()["regions"]
    assert 1 <= len(regions) <= 4
    assert all(len(r.flushed_generations) == 1 and r.current_generation == 2 for r in regions)


def test_rows_land_in_their_bucket_region(table):
    with table.writer() as w:
        w.put(rows(range(100)))
    for st in table.status()["regions"]:
        m = not_none(RegionManifestStore(table.storage, st.region_id).latest())
        uri = table.storage.child_uri(layout.generation_path(st.region_id, m.sstables[0].path))
        ids = lance.dataset(uri, storage_options=table.storage_options or None).to_table()["id"]
        values = not_none(table.spec).evaluate(pa.table({"id": ids}), table.schema.field_ids)[0]
        assert set(values.to_pylist()) == {st.values[0]}


def test_durable_writes_survive_a_crash(table):
    w = table.writer()
    w.put(rows(range(10)))
    w.delete([3])
    w.abort()  # crash: nothing flushed
    assert stored_rows(table) == expected(rows([1, 2, 3], "base"))
    with table.writer() as w2:  # claims the region of key 100 again and replays its WAL
        w2.put(rows([100]))
    recovered = table.recover()  # claims, replays and flushes every other region
    assert recovered
    assert stored_rows(table) == expected(rows([1, 2, 3], "base"), rows(range(10)), rows([100]), deleted=[3])
    assert table.recover() == []  # nothing left to recover


def test_replay_rebuilds_memtable_with_fence_sentinel(table):
    rid = table.region_id_for((0,))
    keys = [
        k
        for k in range(200)
        if not_none(table.spec).evaluate(pa.table({"id": [k]}), table.schema.field_ids)[0][0].as_py() == 0
    ]
    w = table.routed_writer((0,), mw.WriterConfig())
    w.put(rows(keys[:5]))
    w.put(rows(keys[5:8]))
    w.abort()
    w2 = table.routed_writer((0,), mw.WriterConfig())
    assert w2.epoch == 2
    assert sorted(r["id"] for r in w2.memtables[-1].newest().to_pylist()) == sorted(keys[:8])
    sentinel = not_none(Wal(table.storage, rid).read(3))
    assert sentinel.is_sentinel and sentinel.writer_epoch == 2
    m = not_none(RegionManifestStore(table.storage, rid).latest())
    assert (m.version, m.writer_epoch, m.wal_entry_position_last_seen) == (3, 2, 3)
    w2.close()
    assert not_none(RegionManifestStore(table.storage, rid).latest()).replay_after_wal_entry_position == 3


def test_fenced_writer_fails_and_new_writer_keeps_its_entries(manual_table):
    """Appendix 1: A's entries written before B claimed are replayed by B; A is fenced afterwards."""
    rid = uuid.uuid4()
    a = manual_table.region_writer(rid)
    a.put(rows([1, 2]))
    b = manual_table.region_writer(rid)
    with pytest.raises(errors.WriterFencedError):
        a.put(rows([3]))
    with pytest.raises(errors.WriterFencedError):
        a.flush()
    b.put(rows([4]))
    b.close()
    a.close()  # closing a fenced writer does not raise
    assert stored_rows(manual_table) == expected(rows([1, 2, 3], "base"), rows([1, 2]), rows([4]))


def _wait_for_entry(wal: Wal, position: int, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while (entry := wal.read(position)) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return entry


def test_non_durable_writes_batch_into_multi_batch_entries(manual_table):
    rid = uuid.uuid4()
    w = manual_table.region_writer(
        rid, durable=False, max_wal_flush_interval_ms=60_000, max_wal_buffer_batches=5
    )
    for i in range(5):
        w.put(rows([10 + i]))
    entry = _wait_for_entry(Wal(manual_table.storage, rid), 1)  # the 5th write filled the buffer
    assert len(entry.batches) == 5 and entry.generation == 1
    w.close()


def test_sealed_non_durable_writes_are_made_durable_by_their_generation(manual_table):
    """Writes still buffered when their MemTable is sealed get no WAL entry: the generation holds them.
    A newer WAL entry waits for that generation's commit (here stalled), so that a crash can never
    keep newer writes and lose older ones."""
    from support.faulty_storage import FaultPlan, FaultyStorage

    plan = FaultPlan(delay_s=0.5)
    manual_table.storage = FaultyStorage(manual_table.storage, plan)
    rid = uuid.uuid4()
    w = manual_table.region_writer(rid, durable=False, max_wal_flush_interval_ms=10, max_memtable_rows=4)
    wal, store = Wal(manual_table.storage, rid), RegionManifestStore(manual_table.storage, rid)
    plan.force("delay", lambda op, path: op == "put" and path.endswith("_gen_1/bloom_filter.bin"))
    w.put(rows([1, 2, 3, 4]))  # seals generation 1 before its WAL entry was due
    w.put(rows([5], "b"))  # due after 10 ms, but generation 1 is not committed for 0.5 s
    time.sleep(0.2)
    assert wal.read(1) is None and not not_none(store.latest()).sstables
    entry = _wait_for_entry(wal, 1)
    assert [r["id"] for b in entry.batches for r in b.to_pylist()] == [5]
    assert [s.generation for s in not_none(store.latest()).sstables] == [1]  # committed before the entry
    assert plan.injected["delay"] == 1
    w.abort()  # a crash: generation 1 and the WAL entry after it are all there is
    assert manual_table.recover() == [rid]  # replays entry 1 into generation 2
    assert stored_rows(manual_table) == expected(rows([1, 2, 3], "base"), rows([1, 2, 3, 4]), rows([5], "b"))


def test_non_durable_writes_are_lost_on_crash_before_the_interval(manual_table):
    rid = uuid.uuid4()
    w = manual_table.region_writer(rid, durable=False, max_wal_flush_interval_ms=60_000)
    w.put(rows([10]))
    w.abort()
    with manual_table.region_writer(rid) as w2:
        assert w2.memtables[-1].num_rows == 0


def test_memtable_flushes_by_row_threshold(manual_table):
    rid = uuid.uuid4()
    with manual_table.region_writer(rid, max_memtable_rows=10) as w:
        for i in range(5):
            w.put(rows(range(i * 10, i * 10 + 10)))
    m = not_none(RegionManifestStore(manual_table.storage, rid).latest())
    assert [s.generation for s in m.sstables] == [1, 2, 3, 4, 5]
    assert m.current_generation == 6


@pytest.mark.parametrize(
    "bad, error",
    [
        (pa.table({"id": [1], "name": ["x"], "v": [1.0], "extra": [1]}), errors.SchemaMismatchError),
        (pa.table({"id": [1], "name": [1.5], "v": [1.0]}), errors.SchemaMismatchError),
        (pa.table({"name": ["x"], "v": [1.0]}), errors.SchemaMismatchError),
        (
            pa.table({"id": pa.array([1, None], pa.int64()), "name": ["x", "y"], "v": [1.0, 2.0]}),
            errors.NullPrimaryKeyError,
        ),
        ("not a table", errors.SchemaMismatchError),
    ],
)
def test_bad_input_is_rejected_and_table_intact(table, bad, error):
    with table.writer() as w:
        w.put(rows([7]))
        with pytest.raises(error):
            w.put(bad)
    assert stored_rows(table) == expected(rows([1, 2, 3], "base"), rows([7]))


def test_key_routed_to_the_wrong_region_is_rejected(table):
    w = table.routed_writer((1,), mw.WriterConfig())
    (buckets,) = not_none(table.spec).evaluate(rows(range(50)), table.schema.field_ids)
    mine = [k for k, b in enumerate(buckets.to_pylist()) if b == 1]
    other = next(k for k, b in enumerate(buckets.to_pylist()) if b != 1)
    with pytest.raises(errors.RegionRoutingError, match=rf"^row {other} belongs to region value"):
        w.put(rows(range(50)))  # 50 keys cannot all hash to bucket 1
    # One stray key after rows that belong: rejected, naming that row; the batch is not written.
    with pytest.raises(errors.RegionRoutingError, match=rf"^row {len(mine)} belongs"):
        w.put(rows([*mine, other]))
    w.put(rows(mine))  # every row belongs: accepted
    w.close()
    assert stored_rows(table) == expected(rows([1, 2, 3], "base"), rows(mine))


def test_truncated_wal_entry_gives_typed_error_naming_the_file(manual_table):
    rid = uuid.uuid4()
    w = manual_table.region_writer(rid)
    w.put(rows([1, 2, 3]))
    w.abort()
    path = layout.wal_path(rid, 1)
    data = manual_table.storage.get(path)
    manual_table.storage.put(path, data[: len(data) // 2])
    with pytest.raises(errors.CorruptWalEntryError) as e:
        manual_table.region_writer(rid)
    assert path in str(e.value)
    manual_table.storage.put(path, data)  # restored: the region is usable again
    with manual_table.region_writer(rid) as w2:
        assert w2.memtables[-1].num_rows == 3


def test_reopen_table_and_status(table, table_uri, table_storage_options):
    with table.writer() as w:
        w.put(rows(range(10)))
    t2 = mw.open_table(table_uri, table_storage_options)
    assert t2.schema.primary_key == ("id",)
    st = t2.status()
    assert st["base_rows"] == 3 and sum(len(r.flushed_generations) for r in st["regions"]) == len(
        st["regions"]
    )


def test_create_table_twice_fails(table, table_uri, table_storage_options):
    with pytest.raises(errors.TableExistsError):
        mw.create_table(table_uri, SCHEMA, "id", storage_options=table_storage_options)


def test_open_plain_lance_table_without_memwal_fails(tmp_path):
    lance.write_dataset(rows([1]), str(tmp_path / "plain"))
    with pytest.raises(errors.TableNotFoundError):
        mw.open_table(str(tmp_path / "plain"))


@pytest.mark.parametrize("pk_type", [pa.float64(), pa.date32(), pa.timestamp("us")])
def test_unsupported_primary_key_types_are_rejected(tmp_path, pk_type):
    schema = pa.schema([pa.field("k", pk_type, nullable=False), pa.field("v", pa.int64())])
    with pytest.raises(errors.SchemaMismatchError, match="not supported"):
        mw.create_table(str(tmp_path / "t"), schema, "k")
    assert not (tmp_path / "t").exists()


def test_missing_primary_key_column_is_rejected(tmp_path):
    with pytest.raises(errors.SchemaMismatchError):
        mw.create_table(str(tmp_path / "t"), SCHEMA, "nope")


def test_backpressure_blocks_then_times_out_with_a_clear_error(manual_table, monkeypatch):
    """Writes block while unflushed bytes exceed the limit and fail with a typed error after the timeout."""
    import threading

    from memwal_df.write import flush, generation

    release = threading.Event()
    real = generation.write_generation

    def slow_write_generation(*args, **kwargs):  # a stalled store: the flush cannot finish
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(flush, "write_generation", slow_write_generation)
    w = manual_table.region_writer(
        uuid.uuid4(), max_memtable_rows=10, max_unflushed_memtable_bytes=1, backpressure_timeout_s=0.3
    )
    w.put(rows(range(10)))  # fills the MemTable: sealed, its flush stalls
    with pytest.raises(errors.BackpressureTimeoutError, match="max_unflushed_memtable_bytes"):
        w.put(rows([100]))
    release.set()
    deadline = time.monotonic() + 120  # the flush finishes (however loaded the machine): room again
    while w.stats()["sealed_memtables"] and time.monotonic() < deadline:
        time.sleep(0.01)
    w.put(rows([101]))
    w.close()
    got = stored_rows(manual_table)
    assert set(range(10)) | {101} <= set(got)
    assert 100 not in got  # the write that timed out was not applied


def test_fenced_non_durable_writer_reports_what_was_not_made_durable(manual_table):
    rid = uuid.uuid4()
    a = manual_table.region_writer(rid, durable=False, max_wal_flush_interval_ms=60_000)
    a.put(rows([1, 2]))
    b = manual_table.region_writer(rid)  # claims: A's buffered rows never reached the WAL
    with pytest.raises(errors.WriterFencedError) as e:
        a.flush()
    assert isinstance(e.value.not_durable, pa.Table)
    assert sorted(e.value.not_durable.column("id").to_pylist()) == [1, 2]
    with pytest.raises(errors.WriterFencedError):
        a.put(rows([3]))
    b.close()
    a.close()
    assert {r["id"]: r["name"] for r in stored_rows(manual_table).values()} == {
        1: "base1",
        2: "base2",
        3: "base3",
    }


def test_failed_generation_write_retries_in_a_new_directory(manual_table, monkeypatch):
    from memwal_df.format.pk_index import write_pk_index
    from memwal_df.write import generation

    calls = {"n": 0}
    real = write_pk_index

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("injected: the store refused the pk index")
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "write_pk_index", failing_once)
    rid = uuid.uuid4()
    with manual_table.region_writer(rid) as w:
        w.put(rows([40, 41]))
    m = not_none(RegionManifestStore(manual_table.storage, rid).latest())
    assert [s.generation for s in m.sstables] == [1]
    dirs = [
        d
        for d in manual_table.storage.list_dir(layout.region_dir(rid))
        if layout.parse_generation_dir_name(d)
    ]
    assert len(dirs) == 2 and m.sstables[0].path in dirs  # the failed attempt's directory is not referenced
    assert {40, 41} <= set(stored_rows(manual_table))


def test_empty_writes_write_nothing(table):
    (bucket,) = not_none(table.spec).evaluate(rows([9]), table.schema.field_ids)
    with table.region_writer(values=(bucket[0].as_py(),)) as w:
        w.put(rows([]))
        w.delete([])
        w.put(rows([9]))
        w.put([])
    entries = list(Wal(table.storage, w.region_id).scan(1))
    assert [e.num_rows for e in entries] == [1]
    with table.writer() as tw:
        tw.put(rows([]))
        tw.delete([])
    assert stored_rows(table) == expected(rows([1, 2, 3], "base"), rows([9]))


def test_generation_files_are_durable_before_a_manifest_names_them(tmp_path, monkeypatch):
    """pylance writes local files without fsync: the flush fsyncs every file and directory of the
    generation (and its entry in the region directory) before the manifest commit that lists it."""
    table = mw.create_table(str(tmp_path / "t"), rows([1]), "id", region_spec=mw.unsharded())
    events: list[tuple[str, Any]] = []
    real_fsync, real_commit = os.fsync, RegionManifestStore.commit

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def commit(self, m):
        events.append(("commit", [s.path for s in m.sstables]))
        return real_commit(self, m)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(RegionManifestStore, "commit", commit)
    with table.writer() as w:
        w.put(rows(range(10, 50)))
    first = next(i for i, (kind, v) in enumerate(events) if kind == "commit" and v)
    (rid,) = table.region_ids()
    gen_dir = tmp_path / "t" / layout.generation_path(rid, events[first][1][0])
    synced = {p for kind, p in events[:first] if kind == "fsync"}
    on_disk = {str(p) for p in gen_dir.rglob("*")} | {str(gen_dir), str(gen_dir.parent)}
    assert len(on_disk) > 5 and on_disk <= synced, sorted(on_disk - synced)


def visible_rows(reader: mw.MemWalTable) -> dict:
    return {r["id"]: r for r in reader.to_table().to_pylist()}


def keys_in_two_regions(table: mw.Table) -> tuple[int, int]:
    """Two keys that the table's spec routes to different regions."""
    (buckets,) = not_none(table.spec).evaluate(rows(range(100, 140)), table.schema.field_ids)
    first = buckets[0].as_py()
    other = next(i for i, b in enumerate(buckets.to_pylist()) if b != first)
    return 100, 100 + other


@pytest.mark.parametrize("how", ["close", "with", "abort"])
def test_nothing_is_accepted_after_the_table_writer_closes(table, how):
    """After `close()`, the end of its `with` block or `abort()`, every put, delete and flush raises
    `WriterClosedError`: also an empty write, and a put to a region the writer never opened (which
    would claim a region writer that nobody closes, its rows only in the WAL). Closing again is
    harmless; a reader given the writer sees what a fresh reader sees."""
    mine, other = keys_in_two_regions(table)
    w = table.writer()
    attached = mw.MemWalTable(table, writer=w)
    if how == "with":
        with w:
            w.put(rows([mine]))
    else:
        w.put(rows([mine]))
        w.close() if how == "close" else w.abort()
    opened = list(w.writers)
    calls = {
        "put to a new region": lambda: w.put(rows([other])),
        "put": lambda: w.put(rows([mine], "late")),
        "empty put": lambda: w.put(rows([])),
        "delete": lambda: w.delete([mine]),
        "empty delete": lambda: w.delete([]),
        "flush": w.flush,
    }
    for name, call in calls.items():
        with pytest.raises(errors.WriterClosedError, match="the table writer is closed"):
            call()
        assert list(w.writers) == opened, name
    w.close()
    w.close()
    table.recover()  # (after abort: replays the durable put)
    want = expected(rows([1, 2, 3], "base"), rows([mine]))
    assert stored_rows(table) == want
    assert visible_rows(attached) == want == visible_rows(mw.MemWalTable(table))


def test_nothing_is_accepted_after_a_region_writer_closes(table):
    """A region writer refuses every put, delete and flush once closed (also empty writes); closing
    again is harmless."""
    mine, _ = keys_in_two_regions(table)
    with table.writer() as w:
        w.put(rows([mine]))
    (region,) = w.writers
    rw = table.region_writer(region)
    rw.put(rows([mine], "b"))
    rw.close()
    for call in (
        lambda: rw.put(rows([mine], "late")),
        lambda: rw.put(rows([])),
        lambda: rw.delete([mine]),
        lambda: rw.delete([]),
        rw.flush,
    ):
        with pytest.raises(errors.WriterClosedError, match=f"the writer of region {region} is closed"):
            call()
    rw.close()
    assert stored_rows(table) == expected(rows([1, 2, 3], "base"), rows([mine], "b"))
