"""Region snapshots, the MemWAL index builder and `MemWalTable(uri, consistency="snapshot")`.

Reads are checked against a dict model of the writes (and against `reference.stored_rows`, a simple
reader of what storage holds) on both storage back-ends: snapshot mode must return exactly the model
as of the last `build_index` (minus nothing, plus nothing), whatever was merged or collected since.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import datafusion
import lance
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lance.file import LanceFileReader
from support.jobs import gc_merged, merge_all, merge_region
from support.optional import not_none
from support.reference import stored_rows

import memwal_df as mw
from memwal_df.errors import InvalidConfigError
from memwal_df.format import base_manifest, memwal_index, region_snapshot
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.spec import RegionSpec
from memwal_df.format.regions.values import encode_region_value
from memwal_df.jobs import index_builder
from memwal_df.read.lsm.snapshot import take_snapshot

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("tag", pa.string())])


def rows(ids: Any, tag: str) -> pa.Table:
    ids = list(ids)
    return pa.table({"id": pa.array(ids, pa.int64()), "tag": [f"{tag}{i}" for i in ids]}, schema=SCHEMA)


class Model:
    """Key -> tag of every acknowledged write (the reference for every read)."""

    def __init__(self, base: pa.Table) -> None:
        self.rows: dict[int, str] = dict(zip(base["id"].to_pylist(), base["tag"].to_pylist(), strict=True))

    def put(self, t: pa.Table) -> None:
        self.rows.update(zip(t["id"].to_pylist(), t["tag"].to_pylist(), strict=True))

    def delete(self, ids: list[int]) -> None:
        for i in ids:
            self.rows.pop(i, None)


def read(
    table: mw.Table, consistency: str = "snapshot", writer: Any = None, where: str = ""
) -> dict[int, str]:
    """The rows a DataFusion query returns (through SQL, so the pushed filter path is exercised)."""
    ctx = datafusion.SessionContext()
    ctx.register_table("t", mw.MemWalTable(table, consistency=consistency, writer=writer))
    out = ctx.sql(f"SELECT id, tag FROM t {where}").to_arrow_table()
    got = dict(zip(out["id"].to_pylist(), out["tag"].to_pylist(), strict=True))
    assert len(got) == out.num_rows, "a key was returned twice"
    return got


def flush(table: mw.Table, model: Model, ids: Any, tag: str, delete: list[int] | None = None) -> None:
    with table.writer(durable=True) as w:
        w.put(rows(ids, tag))
        if delete:
            w.delete(pa.table({"id": pa.array(delete, pa.int64())}))
    model.put(rows(ids, tag))
    model.delete(delete or [])


@pytest.fixture
def table(table_uri: str, table_storage_options: dict[str, str] | None) -> mw.Table:
    return mw.create_table(
        table_uri,
        rows(range(20), "base"),
        "id",
        region_spec=mw.bucket("id", 4),
        storage_options=table_storage_options,
    )


# ------------------------------------------------------------------------------------------------
# Encoding


def test_snapshot_schema_is_the_specs() -> None:
    specs = {
        1: RegionSpec.from_proto(mw.bucket("id", 4).bind({"id": 0}, SCHEMA, primary_key=["id"]).to_proto()),
    }
    schema = region_snapshot.snapshot_schema(specs)
    assert [(f.name, f.type) for f in schema] == [
        ("region_id", pa.binary(16)),
        ("version", pa.uint64()),
        ("region_spec_id", pa.uint32()),
        ("writer_epoch", pa.uint64()),
        ("replay_after_wal_entry_position", pa.uint64()),
        ("wal_entry_position_last_seen", pa.uint64()),
        ("current_generation", pa.uint64()),
        ("flushed_generations", pa.list_(pa.struct([("generation", pa.uint64()), ("path", pa.string())]))),
        ("region_field_bucket", pa.int32()),
    ]


U64 = st.integers(0, 2**64 - 1)


@st.composite
def manifests(draw: st.DrawFn) -> list[pb.ShardManifest]:
    out = []
    for _ in range(draw(st.integers(0, 6))):
        m = pb.ShardManifest(
            version=draw(U64),
            writer_epoch=draw(U64),
            replay_after_wal_entry_position=draw(U64),
            wal_entry_position_last_seen=draw(U64),
            current_generation=draw(U64),
            shard_spec_id=draw(st.sampled_from([0, 1, 2, 7])),
        )
        m.shard_id.uuid = draw(st.uuids()).bytes
        for g in draw(st.lists(U64, max_size=4)):
            m.sstables.add(generation=g, path=f"{g % 2**32:08x}_gen_{g}")
        if m.shard_spec_id == 1 and draw(st.booleans()):
            m.shard_field_entries.add(
                field_id="bucket", value=encode_region_value(draw(st.integers(0, 3)), "int32")
            )
        if m.shard_spec_id == 2 and draw(st.booleans()):
            m.shard_field_entries.add(field_id="bucket", value=encode_region_value(draw(st.text()), "utf8"))
            m.shard_field_entries.add(
                field_id="day", value=encode_region_value(draw(st.integers(1, 31)), "int32")
            )
        out.append(m)
    return out


_SPECS = {
    1: pb.ShardingSpec(
        spec_id=1,
        fields=[
            pb.ShardingField(
                field_id="bucket",
                source_ids=[0],
                transform="bucket",
                result_type="int32",
                parameters={"num_buckets": "4"},
            )
        ],
    ),
    2: pb.ShardingSpec(
        spec_id=2,
        fields=[
            pb.ShardingField(field_id="bucket", source_ids=[1], transform="identity", result_type="utf8"),
            pb.ShardingField(field_id="day", source_ids=[2], transform="day", result_type="int32"),
        ],
    ),
}


@settings(max_examples=60, deadline=None)
@given(manifests())
def test_encode_decode_round_trip(ms: list[pb.ShardManifest]) -> None:
    specs = {i: RegionSpec.from_proto(s) for i, s in _SPECS.items()}
    back = region_snapshot.decode(region_snapshot.encode(ms, specs), specs)
    expected = []
    for m in ms:
        e = pb.ShardManifest()
        e.CopyFrom(m)
        if m.shard_spec_id == 1:
            # "bucket" is utf8 in the newer spec 2: spec 1's int32 values cannot be stored, so they
            # read back as unknown (never pruned) instead of as wrong values.
            e.ClearField("shard_field_entries")
        if m.shard_spec_id not in specs:
            e.ClearField("shard_field_entries")
        expected.append(e)
    assert back == expected


def test_empty_snapshot_is_an_empty_file_with_the_schema() -> None:
    data = region_snapshot.encode([], {})
    assert region_snapshot.decode(data, {}) == []


# ------------------------------------------------------------------------------------------------
# Reading in snapshot mode


def test_snapshot_mode_sees_the_last_build(table: mw.Table) -> None:
    model = Model(rows(range(20), "base"))
    flush(table, model, range(10, 30), "a", delete=[3])
    built = table.build_index()
    assert built.location == "inline" and built.regions == 4 and built.generations == 4
    at_build = dict(model.rows)
    flush(table, model, range(25, 40), "b", delete=[11])  # after the build: not in the snapshot
    assert read(table) == at_build
    assert read(table, "latest") == model.rows == {k: r["tag"] for k, r in stored_rows(table).items()}
    assert read(table, where="WHERE id IN (11, 26, 3)") == {k: at_build[k] for k in (11, 26) if k in at_build}

    # Merged generations are read from the base table, which is always the latest version: once
    # merged, the post-build writes are visible too, and collecting what the snapshot lists is safe.
    merge_all(table)
    assert read(table) == model.rows
    gc_merged(table)
    assert read(table) == model.rows
    assert table.build_index().generations == 8
    flush(table, model, range(40, 45), "c")
    assert read(table) == {k: v for k, v in model.rows.items() if k < 40}
    assert read(table, "latest") == model.rows


def test_merged_generations_of_the_snapshot_are_skipped(table: mw.Table) -> None:
    model = Model(rows(range(20), "base"))
    flush(table, model, range(0, 8), "a")
    flush(table, model, range(0, 4), "b", delete=[7])
    table.build_index()
    region = next(r for r in table.region_ids() if merge_region(table, r, up_to=1))
    snap = take_snapshot(table, "snapshot")
    assert snap.consistency == "snapshot"
    levels = next(r for r in snap.regions if r.region_id == region).levels
    assert [lv.generation for lv in levels] == [2]
    assert read(table) == model.rows


def test_regions_created_after_the_build_are_invisible(table: mw.Table) -> None:
    model = Model(rows(range(20), "base"))
    with table.writer() as w:
        w.put(rows([100], "a"))
    model.put(rows([100], "a"))
    before = set(table.region_ids())
    table.build_index()
    new_ids = next(i for i in range(101, 200) if _regions_of(table, rows([i], "x")) - before)
    flush(table, Model(rows([], "")), [new_ids], "new")
    assert {r.region_id for r in take_snapshot(table, "snapshot").regions} == before
    assert read(table) == model.rows
    assert new_ids in read(table, "latest")


def _regions_of(table: mw.Table, data: pa.Table) -> set[uuid.UUID]:
    values = not_none(table.spec).evaluate(data, table.schema.field_ids)
    return {table.region_id_for(tuple(v[0].as_py() for v in values))}


def test_without_a_snapshot_it_reads_manifests(table: mw.Table) -> None:
    model = Model(rows(range(20), "base"))
    flush(table, model, range(5, 25), "a")
    assert take_snapshot(table, "snapshot").consistency == "latest"
    assert read(table) == model.rows


def test_writer_in_snapshot_mode_reads_its_own_writes(table: mw.Table) -> None:
    model = Model(rows(range(20), "base"))
    table.build_index()
    other = Model(rows([], ""))
    flush(table, other, [50, 51, 52, 53], "other")  # another writer's flush after the build: invisible
    with table.writer(durable=True, max_memtable_rows=100_000) as w:
        w.put(rows([1, 2, 60], "w1"))
        w.flush()  # flushed after the build: visible through the writer's own manifest
        w.put(rows([2, 61], "w2"))  # unflushed
        model.put(rows([1, 2, 60], "w1"))
        model.put(rows([2, 61], "w2"))
        own = set().union(*(_regions_of(table, rows([i], "")) for i in [1, 2, 60, 61]))
        seen = read(table, writer=w)
    visible_other = {i: f"other{i}" for i in [50, 51, 52, 53] if _regions_of(table, rows([i], "")) <= own}
    assert seen == model.rows | visible_other


def test_unknown_consistency_mode_is_a_typed_error(table: mw.Table) -> None:
    with pytest.raises(InvalidConfigError):
        mw.MemWalTable(table, consistency="eventual")
    with pytest.raises(InvalidConfigError):
        take_snapshot(table, "strong")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# The builder


def test_more_than_the_threshold_goes_to_an_external_file(tmp_path) -> None:
    t = mw.create_table(str(tmp_path / "t"), rows(range(10), "base"), "id")  # manual regions
    ids = sorted(uuid.uuid4() for _ in range(region_snapshot.INLINE_THRESHOLD + 3))
    model = Model(rows(range(10), "base"))
    for n, region_id in enumerate(ids):
        with t.region_writer(region_id) as rw:
            if n % 40 == 0:
                rw.put(rows([n, 1000 + n], f"r{n}-"))
                model.put(rows([n, 1000 + n], f"r{n}-"))
    built = t.build_index()
    assert built.regions == len(ids) and built.generations == 3
    assert built.location == region_snapshot.external_path(built.snapshot_ts_millis)
    assert not t.details.HasField("inline_snapshots")
    file = LanceFileReader(t.storage.child_uri(built.location)).read_all().to_table()
    assert file.schema == region_snapshot.snapshot_schema({})
    assert sorted(uuid.UUID(bytes=b) for b in file["region_id"].to_pylist()) == ids
    assert read(t) == model.rows
    # A second build writes a new file and leaves the first one (garbage collection's job).
    again = t.build_index()
    assert again.location != built.location and t.storage.exists(built.location)
    # A smaller table goes back inline.
    small = index_builder.build_index(t, inline_threshold=1000)
    assert small.location == "inline" and read(t) == model.rows


def test_builder_advances_stale_wal_hints(table: mw.Table) -> None:
    (buckets,) = not_none(table.spec).evaluate(rows(range(100, 120), "k"), table.schema.field_ids)
    a, b = [k for k, bucket in zip(range(100, 120), buckets.to_pylist(), strict=True) if bucket == 0][:2]
    rw = table.region_writer(values=(0,))
    region_id = rw.region_id
    rw.put(rows([a], "a"))
    rw.put(rows([b], "b"))  # two durable WAL entries; the manifest does not know them yet
    store = RegionManifestStore(table.storage, region_id)
    assert not_none(store.latest()).wal_entry_position_last_seen == 0
    built = table.build_index()
    assert built.last_seen_advanced == 1
    assert not_none(store.latest()).wal_entry_position_last_seen == 2
    assert table.build_index().last_seen_advanced == 0
    rw.close()  # the writer is not fenced by the builder's manifest commit
    assert {a, b} <= set(read(table, "latest"))


def test_build_keeps_configuration_and_merge_progress(table: mw.Table) -> None:
    model = Model(rows(range(20), "base"))
    flush(table, model, range(0, 12), "a")
    merge_all(table)
    before = table.details
    table.build_index()
    after = table.details
    for name in ("sharding_specs", "num_shards", "maintain_all_indexes", "compacted_sstables"):
        assert getattr(after, name) == getattr(before, name)
    assert after.snapshot_ts_millis > 0 and after.HasField("inline_snapshots")


@pytest.mark.parametrize("inline_threshold", [100, 0])
def test_builds_racing_merges_never_lose_merge_progress(tmp_path, inline_threshold: int) -> None:
    table = mw.create_table(
        str(tmp_path / "t"), rows(range(40), "base"), "id", region_spec=mw.bucket("id", 2)
    )
    model = Model(rows(range(40), "base"))
    for round_ in range(4):
        flush(table, model, range(round_ * 10, round_ * 10 + 15), f"r{round_}-")
    errors: list[BaseException] = []
    done = threading.Event()

    def merger() -> None:
        try:
            merger_table = mw.open_table(table.uri)
            for region_id in merger_table.region_ids():
                for gen in range(1, 5):
                    merge_region(merger_table, region_id, up_to=gen)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=merger)
    thread.start()
    builds = 0
    builder_table = mw.open_table(table.uri)
    while not done.is_set() or builds == 0:
        index_builder.build_index(builder_table, inline_threshold=inline_threshold)
        builds += 1
    thread.join()
    assert not errors, errors
    table.build_index()
    # Merge progress never goes backwards, in any version (the entry lease keeps merges out of a
    # builder's commit window; before it, Lance rebased the builder's entry over a merge).
    last: dict[uuid.UUID, int] = {}
    for version in range(1, base_manifest.latest_version(table.storage) + 1):
        found = memwal_index.read_details(table.uri, version=version)
        merged = memwal_index.merged_generations(found[0]) if found else {}
        assert all(merged.get(r, 0) >= g for r, g in last.items()), f"version {version} went back"
        last = merged
    assert last == {r: 4 for r in table.region_ids()}
    assert read(table) == model.rows == read(table, "latest")


# ------------------------------------------------------------------------------------------------
# Interoperability with Lance 14


@pytest.mark.parametrize("inline_threshold", [100, 0])
def test_lance_still_works_after_build_index(table: mw.Table, inline_threshold: int) -> None:
    model = Model(rows(range(20), "base"))
    flush(table, model, range(10, 30), "a")
    built = index_builder.build_index(table, inline_threshold=inline_threshold)
    options = table.storage_options or None
    ds = lance.dataset(table.uri, storage_options=options)
    assert ds.count_rows() == 20
    assert [i.name for i in ds.describe_indices()] == [memwal_index.MEMWAL_INDEX_NAME]
    assert not_none(ds.mem_wal_index_details())["num_shards"] == 4
    # Lance's writer writes and flushes a region; Lance's merge keeps the snapshot fields.
    native_id = uuid.uuid4()
    native = ds.mem_wal_writer(str(native_id))
    native.put(rows([200, 201], "n"))
    native.close()
    merge_all(table)
    model.put(rows([200, 201], "n"))
    assert table.details.snapshot_ts_millis == built.snapshot_ts_millis
    snap = take_snapshot(table, "snapshot")
    assert snap.consistency == "snapshot" and native_id not in {r.region_id for r in snap.regions}
    assert read(table) == model.rows  # the native region's rows are merged into the base now
    assert table.build_index().regions == 5
    assert read(table) == model.rows == read(table, "latest")
