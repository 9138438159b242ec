"""Interoperability with pylance 14's native MemWAL (Lance's Rust writer and LSM readers), both ways.

Everything here runs real code on both sides against the same table, no mocks:

1. Lance reads ours: `LsmScanner` / `LsmPointLookupPlanner` over ShardSnapshots built from our region
   manifests (minus merged generations) return exactly the model (int64, composite and string keys).
2. Lance reclaims ours: `mem_wal_writer` claims a region memwal_df wrote (crashed or closed), replays
   our WAL, writes its fence sentinel, flushes; then memwal_df reclaims after Lance (also after a
   crashed native writer, replaying its entries).
3. We reclaim Lance's: durable and non-durable (multi-batch entries) native regions, closed or
   crashed in a subprocess (`os._exit`), claimed and replayed by memwal_df; a table made by
   `initialize_mem_wal` opened and written through `table.writer()`.
4. Fencing across implementations, in both directions.
5. Layout: generation directories, SsTable entries, WAL entries and version hints match native ones.
6. Base maintenance: Lance still reads ours after `table.compact` and index segment merges.

The native writer accepts `storage_options`, so the tests taking `table_uri` also run on the moto S3
server. A native "crash" runs the native writer in a subprocess that ends with `os._exit(0)`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from typing import Any

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pytest
from lance.mem_wal import (
    CompactedSsTable,
    LsmPointLookupPlanner,
    LsmScanner,
    ShardSnapshot,
    evaluate_sharding_spec,
)
from support.optional import not_none
from support.reference import stored_rows

import memwal_df as mw
from memwal_df import errors
from memwal_df.format import layout, memwal_index
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.spec import lance_field_ids
from memwal_df.format.wal import CHECKSUM_KEY, Wal, WalEntry
from memwal_df.jobs.compaction import CompactionSettings
from memwal_df.jobs.index_upkeep import IndexUpkeepSettings

SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string()), pa.field("v", pa.float64())]
)
PK_META = {"lance-schema:unenforced-primary-key": "true"}


def rows(ids: Iterable[int], tag: str = "a") -> pa.Table:
    ids = list(ids)
    return pa.table(
        {"id": pa.array(ids, pa.int64()), "name": [f"{tag}{i}" for i in ids], "v": [float(i) for i in ids]},
        schema=SCHEMA,
    )


def id_keys(ids: Iterable[int]) -> pa.Table:
    return pa.table({"id": pa.array(list(ids), pa.int64())})


class Model:
    """Key -> row, applying puts and deletes in order (the expected content of the table)."""

    def __init__(self, pk: Iterable[str], data: pa.Table | None = None) -> None:
        self.pk = tuple(pk)
        self.rows: dict[Any, dict[str, Any]] = {}
        if data is not None:
            self.put(data)

    def key(self, row: dict[str, Any]) -> Any:
        return row[self.pk[0]] if len(self.pk) == 1 else tuple(row[c] for c in self.pk)

    def put(self, data: pa.Table) -> None:
        for r in data.to_pylist():
            self.rows[self.key(r)] = r

    def delete(self, keys: pa.Table) -> None:
        for r in keys.to_pylist():
            self.rows.pop(self.key(r), None)


# ------------------------------------------------------------------------------------------------
# Native access helpers


def lance_ds(table: mw.Table) -> lance.LanceDataset:
    return lance.dataset(table.uri, storage_options=table.storage_options or None)


def snapshots(table: mw.Table, *, skip_merged: bool = True) -> list[ShardSnapshot]:
    """ShardSnapshots of every region from its latest manifest, without merged generations (trap 14)."""
    table.refresh()
    merged = memwal_index.merged_generations(table.details) if skip_merged else {}
    snaps = []
    for region_id in table.region_ids():
        m = RegionManifestStore(table.storage, region_id).latest()
        if m is None:
            continue
        snap = (
            ShardSnapshot(str(region_id))
            .with_spec_id(m.shard_spec_id)
            .with_current_generation(m.current_generation)
        )
        for sst in sorted(m.sstables, key=lambda s: s.generation):
            if sst.generation > merged.get(region_id, 0):
                snap = snap.with_sstable(sst.generation, sst.path)
        snaps.append(snap)
    return snaps


def key_of(row: dict[str, Any], pk: tuple[str, ...]) -> Any:
    return row[pk[0]] if len(pk) == 1 else tuple(row[c] for c in pk)


def native_scan(table: mw.Table, snaps: list[ShardSnapshot] | None = None) -> dict[Any, dict[str, Any]]:
    """What Lance's LsmScanner returns, keyed by primary key (fails on duplicate keys)."""
    pk = table.schema.primary_key
    snaps = snapshots(table) if snaps is None else snaps
    got = LsmScanner.from_snapshots(lance_ds(table), snaps).to_table()
    assert got.column_names == table.schema.schema.names
    out = {key_of(r, pk): r for r in got.to_pylist()}
    assert len(out) == got.num_rows, "LsmScanner returned a key twice"
    return out


def lookup_key(table: mw.Table, key: Any) -> pa.Array:
    """A point-lookup probe: a one-element array, or a one-row struct array for composite keys."""
    pk, schema = table.schema.primary_key, table.schema.schema
    if len(pk) == 1:
        return pa.array([key], schema.field(pk[0]).type)
    return pa.StructArray.from_arrays(
        [pa.array([v], schema.field(c).type) for c, v in zip(pk, key, strict=True)], names=list(pk)
    )


def native_lookups(table: mw.Table, snaps: list[ShardSnapshot], keys: Iterable[Any]) -> dict[Any, list]:
    """What Lance's LsmPointLookupPlanner returns for each key (rows, table columns only)."""
    names = table.schema.schema.names
    with pytest.MonkeyPatch.context() as mp:
        # Native limitation: the point-lookup planner opens generation datasets without the base
        # dataset's storage_options (LsmScanner passes them on); Lance's AWS_* variables fill the gap.
        for key, value in (table.storage_options or {}).items():
            mp.setenv(key.upper() if key.startswith("aws_") else f"AWS_{key.upper()}", value)
        planner = LsmPointLookupPlanner(lance_ds(table), snaps)
        return {
            k: planner.plan_lookup(lookup_key(table, k)).to_table().select(names).to_pylist() for k in keys
        }


def assert_lance_reads(table: mw.Table, model: Model, probes: Iterable[Any] = ()) -> None:
    """Our oracle and Lance's LSM readers both see exactly the model."""
    assert stored_rows(table) == model.rows
    snaps = snapshots(table)
    assert native_scan(table, snaps) == model.rows
    assert LsmScanner.from_snapshots(lance_ds(table), snaps).count_rows() == len(model.rows)
    probes = list(dict.fromkeys(probes))
    got = native_lookups(table, snaps, probes)
    assert got == {k: [model.rows[k]] if k in model.rows else [] for k in probes}


def native_buckets(table: mw.Table, data: pa.Table) -> list[int]:
    """Bucket values as Lance's own `evaluate_sharding_spec` computes them."""
    ds = lance_ds(table)
    spec = not_none(ds.mem_wal_index_details())["sharding_specs"][-1]
    batch = pa.RecordBatch.from_pydict({c: data.column(c).combine_chunks() for c in data.column_names})
    return evaluate_sharding_spec(batch, spec, ds.lance_schema).column(0).to_pylist()


def keys_in_bucket(table: mw.Table, bucket: int, n: int) -> list[int]:
    candidates = list(range(1000))
    found = [
        k for k, b in zip(candidates, native_buckets(table, id_keys(candidates)), strict=True) if b == bucket
    ]
    assert len(found) >= n
    return found[:n]


def history(table: mw.Table, region_id: uuid.UUID) -> list[pb.ShardManifest]:
    return list(RegionManifestStore(table.storage, region_id).history())


def latest(table: mw.Table, region_id: uuid.UUID) -> pb.ShardManifest:
    m = RegionManifestStore(table.storage, region_id).latest()
    assert m is not None
    return m


def wal_entries(table: mw.Table, region_id: uuid.UUID) -> list[WalEntry]:
    return list(Wal(table.storage, region_id).scan(1))


def raw_wal_entry(
    table: mw.Table, region_id: uuid.UUID, position: int
) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """A WAL entry decoded by pyarrow alone (independent of memwal_df's decoder)."""
    reader = ipc.open_stream(table.storage.get(layout.wal_path(region_id, position)))
    return reader.schema, list(reader)


def version_hint(table: mw.Table, region_id: uuid.UUID) -> bytes:
    return table.storage.get(layout.version_hint_path(region_id))


def generation_uri(table: mw.Table, region_id: uuid.UUID, sst: pb.SsTable) -> str:
    return table.storage.child_uri(layout.generation_path(region_id, sst.path))


# A native writer that dies without flushing or closing (a crash). Runs in its own interpreter.
_NATIVE_CRASH = r"""
import json, os, sys, time
import lance, pyarrow as pa
spec = json.loads(sys.argv[1])
ds = lance.dataset(spec["uri"], storage_options=spec["storage_options"])
w = ds.mem_wal_writer(spec["shard"], **spec["kwargs"])
schema = ds.schema
for op, payload in spec["ops"]:
    if op == "put":
        w.put(pa.Table.from_pylist(payload, schema=schema))
    else:
        keys = pa.schema([schema.field(c) for c in payload[0]])
        w.delete(pa.Table.from_pylist(payload, schema=keys))
time.sleep(spec["sleep"])
os._exit(0)
"""


def native_crash(
    table: mw.Table,
    shard: uuid.UUID,
    ops: list[tuple[str, pa.Table]],
    sleep: float = 0.0,
    **kwargs: Any,
) -> None:
    """Run a native writer on `shard` in a subprocess: claim, apply `ops`, then `os._exit` (no close)."""
    spec = {
        "uri": table.uri,
        "storage_options": table.storage_options or None,
        "shard": str(shard),
        "kwargs": kwargs,
        "ops": [(op, data.to_pylist()) for op, data in ops],
        "sleep": sleep,
    }
    subprocess.run(
        [sys.executable, "-c", _NATIVE_CRASH, json.dumps(spec)], check=True, timeout=120, capture_output=True
    )


@pytest.fixture
def table(table_uri: str, table_storage_options: dict[str, str] | None) -> mw.Table:
    return mw.create_table(
        table_uri,
        rows(range(40), "base"),
        "id",
        region_spec=mw.bucket("id", 4),
        storage_options=table_storage_options,
    )


# ------------------------------------------------------------------------------------------------
# 1. Lance reads what memwal_df wrote


def test_lance_reads_our_regions(table: mw.Table) -> None:
    """Several generations per region with updates, deletes and resurrections: Lance's scan, count and
    point lookups equal the model (keys updated, deleted, resurrected, base-only and absent)."""
    model = Model(["id"], rows(range(40), "base"))
    with table.writer() as w:
        for op, data in [
            ("put", rows(range(30, 90), "a")),
            ("delete", id_keys([1, 2, 35, 999])),
            ("flush", None),
            ("put", rows(range(50, 70), "b")),
            ("delete", id_keys([55, 60, 3])),
            ("flush", None),
            ("put", rows([35, 60, 1, 200], "c")),
            ("delete", id_keys([70, 4, 51])),
        ]:
            if op == "put":
                w.put(data)
                model.put(data)
            elif op == "delete":
                w.delete(data["id"])
                model.delete(data)
            else:
                w.flush()
    regions = table.region_ids()
    assert len(regions) == 4
    for region_id in regions:
        m = latest(table, region_id)
        assert len(m.sstables) >= 2
        assert [s.generation for s in m.sstables] == list(range(1, m.current_generation))
    # updated, new, resurrected, deleted then re-put, deleted in a generation, updated then deleted,
    # base key deleted, base only, never written (deleted while absent), absent
    probes = [50, 200, 35, 60, 55, 51, 2, 10, 999, -5]
    assert_lance_reads(table, model, probes)
    # Lance's own bucket hash puts every row of a generation in the bucket its region stands for;
    # each generation is one fragment (id 0), as `_pk_index` row ids assume.
    for region_id in regions:
        (bucket,) = not_none(not_none(table.region_status(region_id)).values)
        for sst in latest(table, region_id).sstables:
            data = lance.dataset(
                generation_uri(table, region_id, sst), storage_options=table.storage_options or None
            )
            assert set(native_buckets(table, data.to_table(columns=["id"]))) == {bucket}
            assert [f.fragment_id for f in data.get_fragments()] == [0]


def test_lance_reads_ours_without_merged_generations(tmp_path) -> None:
    """A generation merged natively (merge_insert + mark_sstables_as_compacted) is left out of the
    snapshot; listing it would let its stale rows shadow a later base update (Lance does not skip it)."""
    table = mw.create_table(
        str(tmp_path / "t"), rows(range(10), "base"), "id", region_spec=mw.bucket("id", 4)
    )
    model = Model(["id"], rows(range(10), "base"))
    ks = keys_in_bucket(table, 2, 8)
    base_in_bucket = [k for k in ks if k < 10]
    assert base_in_bucket
    region_id = table.region_id_for((2,))
    with table.writer() as w:
        w.put(rows(ks[:6], "g1"))
        w.delete(base_in_bucket[:1])
        w.flush()
        w.put(rows(ks[:2], "g2"))
    gen1, gen2 = latest(table, region_id).sstables
    # Merge generation 1 the native way: tombstones first (no marker), then upserts with the marker.
    g1 = lance.dataset(generation_uri(table, region_id, gen1)).to_table()
    dead = g1.filter(g1["_tombstone"]).drop_columns(["_tombstone"])
    live = g1.filter(pc.invert(g1["_tombstone"])).drop_columns(["_tombstone"])
    ds = lance.dataset(table.uri)
    ds.merge_insert("id").when_matched_delete().execute(dead)
    (
        lance.dataset(table.uri)
        .merge_insert("id")
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .mark_sstables_as_compacted([CompactedSsTable(str(region_id), 1)])
        .execute(live)
    )
    # A later base update of a key that only generation 1 (now merged) holds.
    late = ks[5]
    lance.dataset(table.uri).update({"name": "'late'"}, where=f"id = {late}")
    model.put(rows(ks[:6], "g1"))
    model.delete(id_keys(base_in_bucket[:1]))
    model.put(rows(ks[:2], "g2"))
    model.rows[late] = {**model.rows[late], "name": "late"}
    table.refresh()
    assert memwal_index.merged_generations(table.details) == {region_id: 1}
    assert_lance_reads(table, model, [late, ks[0], base_in_bucket[0], ks[3]])
    # Native readers do what the snapshot says: with generation 1 listed, the stale row wins.
    stale = native_scan(table, snapshots(table, skip_merged=False))
    assert stale[late]["name"] == f"g1{late}"
    assert gen2.generation == 2


KEY_CASES = {
    "composite": (
        pa.schema(
            [
                pa.field("id", pa.int64(), nullable=False),
                pa.field("part", pa.string(), nullable=False),
                pa.field("val", pa.float64()),
            ]
        ),
        ["id", "part"],
        "id",
    ),
    "string": (
        pa.schema([pa.field("key", pa.string(), nullable=False), pa.field("val", pa.int64())]),
        ["key"],
        "key",
    ),
}


def _key_rows(case: str, n: range, tag: int) -> pa.Table:
    schema, _, _ = KEY_CASES[case]
    if case == "composite":
        ids = [i // 2 for i in n]
        parts = ["x" if i % 2 else f"p{i % 7}" for i in n]
        return pa.table({"id": ids, "part": parts, "val": [float(i * 10 + tag) for i in n]}, schema=schema)
    keys = [f"k{i:03d}" if i % 3 else "é" * (i % 5) + str(i) for i in n]
    return pa.table({"key": keys, "val": [i * 10 + tag for i in n]}, schema=schema)


@pytest.mark.parametrize("case", sorted(KEY_CASES))
def test_lance_reads_our_other_key_types(tmp_path, case: str) -> None:
    """Composite (int64, utf8) and utf8 primary keys: the PK sidecars and bloom filters we write serve
    Lance's block filter and point lookups."""
    schema, pk, column = KEY_CASES[case]
    base = _key_rows(case, range(0, 30), 0)
    table = mw.create_table(str(tmp_path / "t"), base, pk, region_spec=mw.bucket(column, 4))
    model = Model(pk, base)
    a, b, c = (
        _key_rows(case, range(20, 60), 1),
        _key_rows(case, range(30, 60), 2),
        _key_rows(case, range(5, 8), 3),
    )
    gone = pa.concat_tables([_key_rows(case, range(44, 46), 9), _key_rows(case, range(0, 2), 9)]).select(pk)
    with table.writer() as w:
        w.put(a)
        w.flush()
        w.put(b)
        w.delete(gone)
        w.flush()
        w.put(c)
    for data in (a, b):
        model.put(data)
    model.delete(gone)
    model.put(c)
    assert all(len(latest(table, r).sstables) >= 2 for r in table.region_ids())
    probes = [model.key(r) for r in pa.concat_tables([base, a, b, c]).to_pylist()]
    absent = ((999, "nope"), (0, "")) if case == "composite" else ("nope", "")
    assert_lance_reads(table, model, [*probes[::3], *[model.key(r) for r in gone.to_pylist()], *absent])


def test_generations_keep_the_table_field_ids_after_schema_evolution(tmp_path) -> None:
    """Lance's readers project a generation by the base table's field ids. After a column
    drop (ids are never reused) and an added column, our generations must carry the table's ids
    (nested ones too, `_tombstone` = max + 1) like Lance's own; with fresh ids 0..n Lance read other
    columns' values (`v` would show `w`'s) and NULL structs. WAL entries go both ways too."""
    evolved = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("junk", pa.string()),
            pa.field("s", pa.struct([("a", pa.int32()), ("b", pa.string())])),
            pa.field("v", pa.float64()),
        ]
    )

    table: mw.Table  # created below; data() reads its schema

    def data(ids: list[int], tag: str, junk: bool = False) -> pa.Table:
        cols = {"id": ids, "s": [{"a": i, "b": tag} for i in ids], "v": [float(i) for i in ids]}
        if junk:
            return pa.table({**cols, "junk": ["x"] * len(ids)}).select(evolved.names).cast(evolved)
        return pa.table({**cols, "w": [i / 2 for i in ids]}, schema=table.schema.schema)

    table = mw.create_table(str(tmp_path / "t"), data(list(range(6)), "base", junk=True), "id")
    lance.dataset(table.uri).drop_columns(["junk"])
    lance.dataset(table.uri).add_columns(pa.field("w", pa.float64()))  # Lance allows only all-NULL adds
    table = mw.open_table(table.uri)
    assert lance_field_ids(lance.dataset(table.uri)) == {"id": 0, "s": 2, "v": 5, "w": 6}
    model = Model(["id"], lance.dataset(table.uri).to_table())
    ours, crashed, native_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()

    with table.region_writer(ours) as rw:  # our generation
        rw.put(data([1, 10], "o"))
        rw.delete([2])
    w = table.region_writer(crashed)  # our WAL, replayed by Lance
    w.put(data([3, 11], "c"))
    w.abort()
    lance.dataset(table.uri).mem_wal_writer(str(crashed)).close()
    native = lance.dataset(table.uri).mem_wal_writer(str(native_id))  # Lance's WAL, replayed by us
    native.put(data([4, 12], "n"))
    table.region_writer(native_id).close()
    with pytest.raises(OSError, match="Writer fenced"):
        native.close()
    for d in (data([1, 10], "o"), data([3, 11], "c"), data([4, 12], "n")):
        model.put(d)
    model.delete(id_keys([2]))
    assert_lance_reads(table, model, [1, 2, 3, 4, 10, 11, 12, 5])

    expected = {"id": 0, "s": 2, "v": 5, "w": 6, "_tombstone": 7}
    for region_id in (ours, crashed, native_id):
        (sst,) = latest(table, region_id).sstables
        gen = lance.dataset(generation_uri(table, region_id, sst))
        assert lance_field_ids(gen) == expected
        (s_field,) = [f for f in gen.lance_schema.fields() if f.name() == "s"]
        assert [c.id() for c in s_field.children()] == [3, 4]
        assert len(gen.get_fragments()) == 1 and gen.get_fragments()[0].fragment_id == 0


# ------------------------------------------------------------------------------------------------
# 2. Lance reclaims what memwal_df wrote, and memwal_df reclaims after Lance


@pytest.mark.parametrize("ours_end", ["abort", "close"])
def test_lance_reclaims_our_region_and_we_reclaim_back(table: mw.Table, ours_end: str) -> None:
    model = Model(["id"], rows(range(40), "base"))
    ks = keys_in_bucket(table, 0, 24)
    base_key = next(k for k in ks if k < 40)
    region_id = table.region_id_for((0,))

    # memwal_df writes durably, flushes once, writes more, then crashes (abort) or closes.
    w = table.writer()
    w.put(rows(ks[:6], "a"))
    w.flush()
    w.put(rows(ks[4:9], "b"))
    w.delete([ks[0], base_key])
    getattr(w, ours_end)()
    model.put(rows(ks[:6], "a"))
    model.put(rows(ks[4:9], "b"))
    model.delete(id_keys([ks[0], base_key]))
    ours = latest(table, region_id)
    last = Wal(table.storage, region_id).last_position(1)
    assert last == 3 and (ours.replay_after_wal_entry_position == (3 if ours_end == "close" else 1))

    # Lance claims: epoch + 1, our WAL replayed, fence sentinel, a second manifest with last_seen.
    native = lance_ds(table).mem_wal_writer(str(region_id))
    claim, seen = history(table, region_id)[-2:]
    assert (claim.version, seen.version) == (ours.version + 1, ours.version + 2)
    expect = pb.ShardManifest()
    expect.CopyFrom(ours)
    expect.version, expect.writer_epoch = ours.version + 1, ours.writer_epoch + 1
    assert claim == expect  # everything else copied, our shard_field_entries included
    sentinel = not_none(Wal(table.storage, region_id).read(last + 1))
    assert sentinel.is_sentinel and sentinel.writer_epoch == claim.writer_epoch
    assert seen.wal_entry_position_last_seen == last + 1
    assert seen.replay_after_wal_entry_position == ours.replay_after_wal_entry_position
    native.put(rows(ks[9:12], "n"))
    native.delete(id_keys([ks[5]]))
    native.close()
    model.put(rows(ks[9:12], "n"))
    model.delete(id_keys([ks[5]]))
    after = latest(table, region_id)
    assert after.writer_epoch == claim.writer_epoch
    assert after.replay_after_wal_entry_position == last + 3 == after.wal_entry_position_last_seen
    assert after.current_generation == ours.current_generation + 1
    assert list(after.sstables[: len(ours.sstables)]) == list(ours.sstables)
    assert list(after.shard_field_entries) == list(ours.shard_field_entries)
    assert version_hint(table, region_id) == b'{"version":%d}' % after.version
    assert_lance_reads(table, model, [ks[0], ks[5], ks[6], ks[10], base_key])

    # A second native writer claims and crashes after durable writes (its WAL is not flushed).
    native_crash(table, region_id, [("put", rows(ks[12:15], "m")), ("delete", id_keys([ks[1]]))])
    crashed = latest(table, region_id)
    assert crashed.writer_epoch == after.writer_epoch + 1
    entries = wal_entries(table, region_id)[after.replay_after_wal_entry_position :]
    assert [(e.is_sentinel, e.writer_epoch, e.num_rows) for e in entries] == [
        (True, crashed.writer_epoch, 0),
        (False, crashed.writer_epoch, 3),
        (False, crashed.writer_epoch, 1),
    ]

    # memwal_df reclaims: replays Lance's sentinel and entries, then writes on top.
    rw = table.region_writer(region_id)
    assert rw.epoch == crashed.writer_epoch + 1
    assert rw.stats()["memtable_rows"] == 4
    rw.put(rows(ks[15:17], "z"))
    rw.close()
    model.put(rows(ks[12:15], "m"))
    model.delete(id_keys([ks[1]]))
    model.put(rows(ks[15:17], "z"))
    final = latest(table, region_id)
    n = Wal(table.storage, region_id).last_position(1)
    assert final.writer_epoch == rw.epoch and final.replay_after_wal_entry_position == n
    assert wal_entries(table, region_id)[after.replay_after_wal_entry_position + 3].is_sentinel
    assert_lance_reads(table, model, [ks[1], ks[13], ks[15], ks[5], 1000])


def test_lance_replays_our_multi_batch_entries(tmp_path) -> None:
    """A non-durable memwal_df writer packs several writes into one WAL entry; Lance replays them all."""
    table = mw.create_table(str(tmp_path / "t"), rows(range(5), "base"), "id", region_spec=None)
    region_id = uuid.uuid4()
    rw = table.region_writer(
        region_id, durable=False, max_wal_buffer_batches=3, max_wal_flush_interval_ms=600_000
    )
    rw.put(rows(range(3, 10), "a"))
    rw.delete([4, 1])
    rw.put(rows([4, 20], "b"))  # the third batch fills the buffer: one entry, three batches
    deadline = time.monotonic() + 30
    while rw.stats()["buffered_batches"]:  # the writer's WAL thread appends it in the background
        assert time.monotonic() < deadline, "the full WAL buffer was not appended"
        time.sleep(0.002)
    rw.abort()
    (entry,) = wal_entries(table, region_id)
    assert [b.num_rows for b in entry.batches] == [7, 2, 2]
    model = Model(["id"], rows(range(5), "base"))
    model.put(rows(range(3, 10), "a"))
    model.delete(id_keys([4, 1]))
    model.put(rows([4, 20], "b"))
    lance.dataset(table.uri).mem_wal_writer(str(region_id)).close()
    (sst,) = latest(table, region_id).sstables
    assert sst.physical_rows == 11  # Lance keeps every replayed row; a deletion vector hides old ones
    assert_lance_reads(table, model, [1, 4, 5, 20])


# ------------------------------------------------------------------------------------------------
# 3. memwal_df reclaims regions Lance wrote


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "buffered"])
@pytest.mark.parametrize("end", ["close", "crash"])
def test_we_reclaim_lance_region(table: mw.Table, durable: bool, end: str) -> None:
    model = Model(["id"], rows(range(40), "base"))
    region_id = uuid.uuid4()  # a shard id of the caller's choosing, as native users pick them
    # A durable native put waits for the WAL flusher's next tick: keep the tick short. Buffered writes
    # get a long one so that close() writes them as one entry.
    kwargs: dict[str, Any] = {
        "durable_write": durable,
        "max_wal_flush_interval_ms": 20 if durable else 600_000,
    }
    native = lance_ds(table).mem_wal_writer(str(region_id), **kwargs)
    first = [
        ("put", rows(range(5, 15), "a")),
        ("put", rows(range(12, 20), "b")),
        ("delete", id_keys([6, 13])),
    ]
    for op, data in first:
        getattr(native, op)(data)
        getattr(model, op)(data)
    native.close()
    entries = wal_entries(table, region_id)
    if durable:
        assert [[b.num_rows for b in e.batches] for e in entries] == [[10], [8], [2]]
    else:  # buffered writes go out as one entry holding one batch per call
        assert [[b.num_rows for b in e.batches] for e in entries] == [[10, 8, 2]]
    closed = latest(table, region_id)
    assert closed.replay_after_wal_entry_position == len(entries) and len(closed.sstables) == 1
    replayed = 0
    if end == "crash":
        second = [
            ("put", rows(range(18, 25), "c")),
            ("delete", id_keys([8, 19])),
            ("put", rows([6, 30], "d")),
        ]
        # Buffered: a short flush interval gets the buffer into the WAL before the process dies.
        native_crash(
            table,
            region_id,
            second,
            sleep=0.0 if durable else 1.5,
            durable_write=durable,
            max_wal_flush_interval_ms=20 if durable else 300,
        )
        for op, data in second:
            getattr(model, op)(data)
        tail = wal_entries(table, region_id)[len(entries) :]
        assert tail[0].is_sentinel and tail[0].writer_epoch == closed.writer_epoch + 1
        assert sum(e.num_rows for e in tail) == 11  # nothing lost
        if durable:
            assert [e.num_rows for e in tail[1:]] == [7, 2, 2]
        else:
            assert max(len(e.batches) for e in tail) > 1
        replayed = 11
    before = latest(table, region_id)
    wal_end = Wal(table.storage, region_id).last_position(1)
    rw = table.region_writer(region_id)
    assert rw.epoch == before.writer_epoch + 1
    assert rw.stats()["memtable_rows"] == replayed  # Lance's sentinel skipped, multi-batch entries whole
    ours_sentinel = not_none(Wal(table.storage, region_id).read(wal_end + 1))
    assert ours_sentinel.is_sentinel and ours_sentinel.writer_epoch == rw.epoch
    assert latest(table, region_id).wal_entry_position_last_seen == wal_end + 1
    rw.put(rows([7, 31], "z"))
    rw.delete([12, 0])
    rw.close()
    model.put(rows([7, 31], "z"))
    model.delete(id_keys([12, 0]))
    m = latest(table, region_id)
    assert m.replay_after_wal_entry_position == Wal(table.storage, region_id).last_position(1)
    assert len(m.sstables) == 2  # replayed rows and new ones share our first MemTable
    assert_lance_reads(table, model, [6, 7, 8, 12, 13, 19, 30, 31, 0, 1, 999])


def test_recover_replays_a_crashed_native_writer(tmp_path) -> None:
    """`table.recover()` finds a region with unflushed native WAL entries and flushes them."""
    table = mw.create_table(str(tmp_path / "t"), rows(range(5), "base"), "id", region_spec=mw.bucket("id", 4))
    region_id = uuid.uuid4()
    native_crash(table, region_id, [("put", rows([1, 50], "a")), ("delete", id_keys([2]))])
    assert latest(table, region_id).sstables == []
    assert table.recover() == [region_id]
    model = Model(["id"], rows(range(5), "base"))
    model.put(rows([1, 50], "a"))
    model.delete(id_keys([2]))
    assert_lance_reads(table, model, [1, 2, 50])
    assert table.recover() == []


def test_native_initialized_table_written_by_us(table_uri: str, table_storage_options) -> None:
    """A table made by pylance + `initialize_mem_wal(bucket_column="id", num_buckets=4, ...)` opens with
    `mw.open_table`, takes the table's writer defaults and routes rows with Lance's bucket hash."""
    schema = pa.schema([SCHEMA.field("id").with_metadata(PK_META), SCHEMA.field("name"), SCHEMA.field("v")])
    base = rows(range(20), "base").cast(schema)
    ds = lance.write_dataset(base, table_uri, storage_options=table_storage_options)
    ds.initialize_mem_wal(bucket_column="id", num_buckets=4, max_memtable_rows=25)
    table = mw.open_table(table_uri, storage_options=table_storage_options)
    assert table.schema.primary_key == ("id",)
    assert table.spec is not None and table.details.num_shards == 4
    model = Model(["id"], base)
    with table.writer() as w:
        assert w.config.max_memtable_rows == 25
        w.put(rows(range(10, 260), "a"))  # 25-row MemTables: several generations per region
        w.delete([11, 12, 3, 500])
        w.put(rows([3, 12], "b"))
    model.put(rows(range(10, 260), "a"))
    model.delete(id_keys([11, 12, 3]))
    model.put(rows([3, 12], "b"))
    regions = table.region_ids()
    assert len(regions) == 4
    for region_id in regions:
        m = latest(table, region_id)
        assert m.shard_spec_id == 1 and len(m.sstables) >= 2
        (bucket,) = not_none(not_none(table.region_status(region_id)).values)
        for sst in m.sstables:
            data = lance.dataset(generation_uri(table, region_id, sst), storage_options=table_storage_options)
            assert set(native_buckets(table, data.to_table(columns=["id"]))) == {bucket}
    assert_lance_reads(table, model, [3, 11, 12, 15, 60, 500])


def test_lance_reads_a_table_without_spec_written_by_our_table_writer(tmp_path) -> None:
    """`table.writer()` on a table created without a region spec gives it Lance's `unsharded` spec
    (one region): Lance's LSM readers read it, and its writer reclaims the region and writes on."""
    table = mw.create_table(str(tmp_path / "t"), rows(range(5), "base"), "id")
    model = Model(["id"], rows(range(5), "base"))
    with table.writer() as w:
        w.put(rows([1, 7, 8], "a"))
        w.delete([2])
        w.flush()
        w.put(rows([8, 9], "b"))
    model.put(rows([1, 7, 8], "a"))
    model.delete(id_keys([2]))
    model.put(rows([8, 9], "b"))
    (region_id,) = table.region_ids()
    assert table.spec is not None and latest(table, region_id).shard_spec_id == table.spec.spec_id
    assert_lance_reads(table, model, [1, 2, 7, 9, 50])
    native = lance_ds(table).mem_wal_writer(str(region_id))
    native.put(rows([50], "native"))
    native.close()
    model.put(rows([50], "native"))
    assert_lance_reads(table, model, [1, 2, 50])


# ------------------------------------------------------------------------------------------------
# 4. Fencing across implementations


def test_our_claim_fences_a_native_writer(table: mw.Table) -> None:
    region_id = uuid.uuid4()
    native = lance_ds(table).mem_wal_writer(str(region_id))
    native.put(rows([100, 101], "n"))
    rw = table.region_writer(region_id)
    assert rw.epoch == 2 and rw.stats()["memtable_rows"] == 2  # Lance's durable write was replayed
    with pytest.raises(OSError, match="Writer fenced"):
        native.put(rows([102], "lost"))
    with pytest.raises(OSError, match="Writer fenced"):
        native.delete(id_keys([100]))
    with pytest.raises(OSError, match="Writer fenced"):
        native.close()
    rw.put(rows([103], "o"))
    rw.close()
    model = Model(["id"], rows(range(40), "base"))
    model.put(rows([100, 101], "n"))
    model.put(rows([103], "o"))
    assert_lance_reads(table, model, [100, 102, 103])
    assert all(e.writer_epoch <= 2 for e in wal_entries(table, region_id))


def test_native_claim_fences_our_writer(table: mw.Table) -> None:
    k = [key for key in keys_in_bucket(table, 0, 40) if key >= 40][:7]  # new keys of bucket 0
    durable = table.region_writer(values=(0,))
    region_id = durable.region_id
    durable.put(rows(k[0:2], "o"))
    native = lance_ds(table).mem_wal_writer(str(region_id))
    with pytest.raises(errors.WriterFencedError):
        durable.put(rows([k[2]], "lost"))
    with pytest.raises(errors.WriterFencedError):
        durable.delete([k[0]])
    with pytest.raises(errors.WriterFencedError):
        durable.flush()
    durable.close()  # a fenced writer closes without flushing
    native.put(rows([k[3]], "n"))
    native.close()

    # Non-durable: the rows still in our buffer come back on the error, for a retry elsewhere.
    buffered = table.region_writer(region_id, durable=False, max_wal_flush_interval_ms=600_000)
    buffered.put(rows([k[4]], "b"))
    buffered.flush()  # durable now, and flushed
    buffered.put(rows(k[5:7], "late"))
    lance_ds(table).mem_wal_writer(str(region_id)).close()
    with pytest.raises(errors.WriterFencedError) as caught:
        buffered.flush()
    assert isinstance(caught.value.not_durable, pa.Table)
    assert caught.value.not_durable.to_pylist() == [
        {**r, "_tombstone": False} for r in rows(k[5:7], "late").to_pylist()
    ]
    buffered.close()

    model = Model(["id"], rows(range(40), "base"))
    for data in (rows(k[0:2], "o"), rows([k[3]], "n"), rows([k[4]], "b")):
        model.put(data)
    assert_lance_reads(table, model, [k[0], k[2], k[4], k[5]])


# ------------------------------------------------------------------------------------------------
# 5. What we write looks like what Lance writes


def _same_writes(writer: Any) -> None:
    writer.put(rows(range(20), "a"))
    writer.delete(id_keys([3]) if hasattr(writer, "shard_id") else [3])
    writer.put(rows([5, 6], "b"))
    writer.close()


@pytest.mark.parametrize("version", ["2.0", "2.1", None])
def test_generation_layout_matches_native(tmp_path, version: str | None) -> None:
    table = mw.create_table(
        str(tmp_path / "t"), rows(range(3), "base"), "id", region_spec=None, data_storage_version=version
    )
    base_version = lance.dataset(table.uri).data_storage_version
    ours_id, native_id = uuid.uuid4(), uuid.uuid4()
    _same_writes(table.region_writer(ours_id))
    _same_writes(lance.dataset(table.uri).mem_wal_writer(str(native_id)))
    ours, native = latest(table, ours_id), latest(table, native_id)

    # Region manifests: the same fields set, the same life cycle numbers.
    assert [f.name for f, _ in ours.ListFields()] == [f.name for f, _ in native.ListFields()]
    for name in (
        "version",
        "writer_epoch",
        "replay_after_wal_entry_position",
        "wal_entry_position_last_seen",
    ):
        assert getattr(ours, name) == getattr(native, name), name
    assert ours.current_generation == native.current_generation == 2
    (o_sst,), (n_sst,) = ours.sstables, native.sstables
    assert (
        [f.name for f, _ in o_sst.ListFields()]
        == [f.name for f, _ in n_sst.ListFields()]
        == [
            "generation",
            "path",
            "in_memory_bytes",
            "physical_rows",
            "primary_key_bytes",
        ]
    )
    assert layout.parse_generation_dir_name(o_sst.path) == (o_sst.path[:8], 1)
    for region_id, m in ((ours_id, ours), (native_id, native)):
        assert version_hint(table, region_id) == b'{"version":%d}' % m.version
        # every manifest version re-encodes to its own bytes with our proto
        for v in RegionManifestStore(table.storage, region_id).list_versions():
            data = table.storage.get(layout.manifest_path(region_id, v))
            assert pb.ShardManifest.FromString(data).SerializeToString() == data

    # Generation directories: Lance datasets of one version (V2 naming), one fragment, the base
    # table's data storage version, the base schema plus `_tombstone` (id = max + 1) last.
    gens = {}
    for region_id, sst in ((ours_id, o_sst), (native_id, n_sst)):
        rel = layout.generation_path(region_id, sst.path)
        assert table.storage.list_dir(f"{rel}/_versions") == [
            "18446744073709551614.manifest",
            "latest_version_hint.json",
        ]
        ds = lance.dataset(table.storage.child_uri(rel))
        assert ds.version == 1 and ds.data_storage_version == base_version
        (frag,) = ds.get_fragments()
        assert frag.fragment_id == 0 and frag.physical_rows == sst.physical_rows
        assert sst.primary_key_bytes == 8 * sst.physical_rows
        assert ds.schema.names == [*SCHEMA.names, "_tombstone"]
        assert ds.schema.field("_tombstone").type == pa.bool_() and not ds.schema.field("_tombstone").nullable
        assert ds.schema.field("id").metadata == lance.dataset(table.uri).schema.field("id").metadata
        gens[region_id] = ds
    ids = lance_field_ids(gens[ours_id])
    assert ids == lance_field_ids(gens[native_id])
    assert ids["_tombstone"] == max(v for k, v in ids.items() if k != "_tombstone") + 1
    # The live rows, in forward write order: ours has no duplicates, Lance hides them with a deletion vector.
    assert gens[ours_id].to_table() == gens[native_id].to_table()
    assert o_sst.physical_rows == 20 and n_sst.physical_rows == 23
    bloom = [
        table.storage.get(f"{layout.generation_path(r, s.path)}/{layout.BLOOM_FILTER_FILE}")
        for r, s in ((ours_id, o_sst), (native_id, n_sst))
    ]
    assert bloom[0] == bloom[1] and len(bloom[0]) == 32768

    # WAL entries: the same schema (field ids, PK metadata, `_tombstone` last) and metadata keys.
    for position in (1, 2, 3):
        (o_schema, o_batches), (n_schema, n_batches) = (
            raw_wal_entry(table, ours_id, position),
            raw_wal_entry(table, native_id, position),
        )
        assert o_schema.equals(n_schema, check_metadata=True)
        assert o_schema.metadata == {b"generation": b"1", b"writer_epoch": b"1"}
        assert [b.to_pylist() for b in o_batches] == [b.to_pylist() for b in n_batches]


def test_fence_sentinels_match_native(tmp_path) -> None:
    """A reclaim writes the same sentinel entry (content, not bytes: arrow-rs pads differently)."""
    table = mw.create_table(str(tmp_path / "t"), rows(range(3), "base"), "id", region_spec=None)
    ours_id, native_id = uuid.uuid4(), uuid.uuid4()
    table.region_writer(ours_id).close()
    table.region_writer(ours_id).close()
    lance.dataset(table.uri).mem_wal_writer(str(native_id)).close()
    lance.dataset(table.uri).mem_wal_writer(str(native_id)).close()
    o_schema, o_batches = raw_wal_entry(table, ours_id, 1)
    n_schema, n_batches = raw_wal_entry(table, native_id, 1)
    o_meta = dict(o_schema.metadata)
    assert o_meta.pop(CHECKSUM_KEY).isdigit()  # ours carry a checksum (Lance ignores the key)
    assert o_schema.with_metadata(o_meta).equals(n_schema, check_metadata=True)
    assert o_batches == n_batches == []
    assert o_meta == {b"fence_sentinel": b"true", b"writer_epoch": b"2"}
    for v in (1, 2, 3):
        o = not_none(RegionManifestStore(table.storage, ours_id).read(v))
        n = not_none(RegionManifestStore(table.storage, native_id).read(v))
        n.shard_id.uuid = ours_id.bytes
        assert o.SerializeToString() == n.SerializeToString()


def test_claim_of_a_native_region_on_sharded_table_writes_native_manifest_bytes(tmp_path) -> None:
    """Lance's writer creates a region by id on a sharded table (its spec id, no region values).
    memwal_df refuses to create one (`UnknownRegionError`: a region without values accepts any
    key), but claims an existing one, writing the manifest Lance's own claim writes."""
    table = mw.create_table(str(tmp_path / "t"), rows(range(3), "base"), "id", region_spec=mw.bucket("id", 4))
    ours_id, native_id = uuid.uuid4(), uuid.uuid4()
    with pytest.raises(errors.UnknownRegionError):
        table.region_writer(ours_id)
    assert table.region_ids() == []
    for region_id in (ours_id, native_id):
        lance.dataset(table.uri).mem_wal_writer(str(region_id)).close()
    table.region_writer(ours_id).close()
    lance.dataset(table.uri).mem_wal_writer(str(native_id)).close()
    ours, native = history(table, ours_id), history(table, native_id)
    assert len(ours) == len(native) >= 2 and native[0].shard_spec_id == 1
    for o, n in zip(ours, native, strict=True):
        n.shard_id.uuid = ours_id.bytes
        assert o.SerializeToString() == n.SerializeToString()


def test_lance_reads_a_table_written_with_partial_updates(tmp_path):
    """Partial and conditional writes are written as full rows: Lance's LsmScanner and point-lookup
    planner read the generations they produced exactly as the model says (fills from the base, a
    generation and the MemTable; a new key with NULLs; refused conditional rows absent)."""
    table = mw.create_table(str(tmp_path / "t"), rows(range(0, 20, 2)), "id", region_spec=mw.bucket("id", 2))
    model = Model(("id",), rows(range(0, 20, 2)))
    with table.writer() as w:
        w.put({"id": [2, 3, 4], "v": [20.0, 30.0, None]}, partial=True)
        w.flush()
        w.put({"id": [3, 6], "name": ["x", "y"]}, partial=True)
        assert w.insert_if_absent(rows([4, 5], "n")).mask.tolist() == [False, True]
        applied = w.put({"id": [2, 8], "name": ["c2", "c8"]}, partial=True, if_match={"v": 20.0})
        assert applied is not None and applied.mask.tolist() == [True, False]
    model.rows[2] = {"id": 2, "name": "c2", "v": 20.0}
    model.rows[3] = {"id": 3, "name": "x", "v": 30.0}
    model.rows[4] = {"id": 4, "name": "a4", "v": None}
    model.rows[5] = {"id": 5, "name": "n5", "v": 5.0}
    model.rows[6] = {"id": 6, "name": "y", "v": 6.0}
    assert_lance_reads(table, model, probes=[2, 3, 4, 5, 6, 8, 99])


def test_lance_reads_ours_after_compaction_and_index_segment_merges(tmp_path) -> None:
    """Merges leave small fragments with deletion files; index catch-up adds delta segments to a
    vector index, then merges them (`max_segments`) and `table.compact` rewrites the base (indexes
    remapped in its commit), with generations still unmerged above it: Lance's LsmScanner, count and
    point lookups equal the model after each step."""
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("name", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), 2)),
        ]
    )

    def vec_rows(ids: Iterable[int], tag: str) -> pa.Table:
        ids = list(ids)
        return pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "name": [f"{tag}{i}" for i in ids],
                "vec": [[float(i % 7), float(len(tag))] for i in ids],
            },
            schema=schema,
        )

    table = mw.create_table(
        str(tmp_path / "t"), vec_rows(range(40), "base"), "id", region_spec=mw.bucket("id", 2)
    )
    ds = lance_ds(table)
    ds.create_scalar_index("id", "BTREE")
    lance_ds(table).create_index("vec", "IVF_FLAT", num_partitions=1)
    model = Model(["id"], vec_rows(range(40), "base"))
    lax = IndexUpkeepSettings(max_segments=4, retrain_share=100.0)
    probes = [0, 3, 17, 41, 55, 70, 999]

    def segments() -> int:
        return {d.name: len(d.segments) for d in lance_ds(table).describe_indices()}["vec_idx"]

    with table.writer() as w:
        for step, tag in enumerate(["a", "bb", "ccc"]):
            data = vec_rows(range(step * 7, 60 + step * 5, 3), tag)
            w.put(data)
            model.put(data)
            dead = id_keys([step * 3, 17 + step, 41 + step])
            w.delete(dead["id"])
            model.delete(dead)
            w.flush()
            assert table.merge().generations
            (vec,) = [i for i in table.catch_up_indexes(upkeep=lax).indexes if i.name == "vec_idx"]
            assert vec.rebuilt and not vec.merged_segments
            assert_lance_reads(table, model, probes)
        assert segments() == 4
        merged = table.catch_up_indexes(upkeep=IndexUpkeepSettings(max_segments=2, retrain_share=100.0))
        assert any(i.merged_segments for i in merged.indexes) and segments() == 1
        assert_lance_reads(table, model, probes)
        data = vec_rows([1, 3, 41, 70], "dddd")  # an unmerged generation above the compacted base
        w.put(data)
        model.put(data)
        w.flush()
    assert any(f.metadata.deletion_file is not None for f in lance_ds(table).get_fragments())
    before = {f.fragment_id for f in lance_ds(table).get_fragments()}
    done = table.compact(
        CompactionSettings(target_rows_per_fragment=20, small_fragment_rows=20, min_small_fragments=2)
    )
    assert done.compacted and done.fragments_added > 1
    after = lance_ds(table).get_fragments()
    assert {f.fragment_id for f in after} != before
    assert all(f.metadata.deletion_file is None for f in after)
    assert_lance_reads(table, model, probes)
    assert table.merge().generations
    assert_lance_reads(table, model, probes)
