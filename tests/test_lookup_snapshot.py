"""Point-lookup snapshots across queries: one `MemWalTable` registration answering `id = k` / `id IN`
while other table objects write, create regions, merge and garbage-collect in between.

What a lookup snapshot may skip (manifests of regions the keys do not route to, re-opening an unchanged
base) must never change an answer: every answer is compared with `reference.stored_rows` of a separate
table object (the dict model of what is durable), and the manifests read are counted to show the
skipping happens.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import datafusion
import lance
import pyarrow as pa
import pytest
from support.jobs import gc_merged, merge_all
from support.optional import not_none
from support.reference import stored_rows

import memwal_df as mw
from memwal_df.errors import RegionRoutingError
from memwal_df.format.manifest import RegionManifestStore
from memwal_df.read.lookup.planner import plan_point_lookup
from memwal_df.read.lsm import snapshot as snapshot_module
from memwal_df.read.lsm.levels import GenerationLevel
from memwal_df.read.lsm.snapshot import take_snapshot

SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.string())])
N_BASE = 200


def rows(ids: list[int], tag: str) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "v": [f"{tag}{i}" for i in ids]}, schema=SCHEMA)


def by_bucket(t: mw.Table, ids: range) -> dict[int, list[int]]:
    """Keys per bucket value of the table's spec."""
    (values,) = not_none(t.spec).evaluate(
        pa.table({"id": pa.array(list(ids), pa.int64())}), t.schema.field_ids
    )
    out: dict[int, list[int]] = {}
    for k, b in zip(ids, values.to_pylist(), strict=True):
        out.setdefault(b, []).append(k)
    return out


class Reader:
    """One registration (`MemWalTable(uri)`) queried through SQL; answers checked against the model."""

    def __init__(
        self, uri: str, monkeypatch: pytest.MonkeyPatch, storage_options: dict[str, str] | None = None
    ) -> None:
        self.uri, self.options = uri, storage_options
        self.ctx = datafusion.SessionContext()
        self.ctx.register_table("t", mw.MemWalTable(uri, storage_options))
        self.manifests_read: list[uuid.UUID] = []
        reads = self.manifests_read

        class Counted(RegionManifestStore):
            def __init__(self, storage: Any, region_id: uuid.UUID) -> None:
                reads.append(region_id)
                super().__init__(storage, region_id)

        monkeypatch.setattr(snapshot_module, "RegionManifestStore", Counted)  # the snapshot's reads only

    def check(self, keys: list[int]) -> dict[int, str]:
        """Looks `keys` up (`id = k` each, then one `IN` list); asserts both equal the model; returns it."""
        model = stored_rows(mw.open_table(self.uri, self.options))
        want = {k: model[k]["v"] for k in keys if k in model}
        got: dict[int, str] = {}
        for k in keys:
            out = self.ctx.sql(f"SELECT id, v FROM t WHERE id = {k}").to_arrow_table().to_pylist()
            assert len(out) <= 1
            got.update({r["id"]: r["v"] for r in out})
        assert got == want
        listed = ", ".join(map(str, keys))
        out = self.ctx.sql(f"SELECT id, v FROM t WHERE id IN ({listed})").to_arrow_table().to_pylist()
        assert {r["id"]: r["v"] for r in out} == want and len(out) == len(want)
        return want

    def reads_for(self, keys: list[int]) -> set[uuid.UUID]:
        """The regions whose manifests one lookup of `keys` consults."""
        self.manifests_read.clear()
        self.check(keys)
        return set(self.manifests_read)


def test_lookups_follow_new_regions_merges_and_gc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = str(tmp_path / "t")
    t = mw.create_table(uri, rows(list(range(N_BASE)), "b"), "id", region_spec=mw.bucket("id", 4))
    buckets = by_bucket(t, range(N_BASE, N_BASE + 400))
    b0, b1, b2, b3 = (buckets[b] for b in sorted(buckets))
    base_keys = [3, 77, 150]
    region0 = t.region_id_for((sorted(buckets)[0],))
    region1 = t.region_id_for((sorted(buckets)[1],))

    with t.writer() as w:  # region of bucket 0 only: a new key and an update of a base key
        w.put(rows([b0[0], b0[1]], "g1-"))
    reader = Reader(uri, monkeypatch)
    assert reader.check([b0[0], b0[1], b1[0], *base_keys, -1])[b0[0]] == f"g1-{b0[0]}"

    # Keys of bucket 1 have no region yet: no manifest is read for them (region 0 is known).
    assert reader.reads_for([b1[0], b1[1]]) == set()
    assert reader.reads_for([b0[0]]) == {region0}

    # Another process creates the region of bucket 1: the same registration sees it at once.
    other = mw.open_table(uri)
    with other.writer() as w:
        w.put(rows([b1[0]], "g2-"))
        w.delete(pa.table({"id": pa.array([b1[1]], pa.int64())}))
    assert reader.check([b1[0], b1[1], b0[0]]) == {b0[0]: f"g1-{b0[0]}", b1[0]: f"g2-{b1[0]}"}
    assert reader.reads_for([b1[0]]) == {region1}
    assert reader.reads_for([b0[0], b1[0]]) == {region0, region1}
    assert reader.reads_for([b2[0], b3[0]]) == set()

    # A region without region values (Lance's own writer makes one under any region id) may hold
    # any key: every lookup reads it.
    manual = uuid.UUID(int=7, version=4)
    native = lance.dataset(uri).mem_wal_writer(str(manual))
    native.put(rows([b2[0], 5], "manual-"))
    native.close()
    assert reader.check([b2[0], 5, b3[0]]) == {b2[0]: f"manual-{b2[0]}", 5: "manual-5"}
    assert reader.reads_for([b3[0]]) == {manual}
    assert reader.reads_for([b0[0]]) == {region0, manual}

    # Merge between two lookups: the rows come from the new base version, the same answers.
    keys = [b0[0], b0[1], b1[0], b1[1], b2[0], 5, *base_keys]
    before = reader.check(keys)
    merge_all(mw.open_table(uri))
    assert reader.check(keys) == before
    # Generations collected between two lookups (their readers may still be open): same answers.
    assert gc_merged(mw.open_table(uri))
    assert reader.check(keys) == before
    # A newer generation after the merge wins again.
    with other.writer() as w:
        w.put(rows([b0[0], 77], "g3-"))
        w.delete(pa.table({"id": pa.array([b1[0]], pa.int64())}))
    after = reader.check(keys)
    assert after[b0[0]] == f"g3-{b0[0]}" and after[77] == "g3-77" and b1[0] not in after


def test_base_reopened_only_when_its_version_changes(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    t = mw.create_table(uri, rows(list(range(N_BASE)), "b"), "id", region_spec=mw.bucket("id", 4))
    reader = mw.open_table(uri)
    keys = pa.table({"id": pa.array([1, 2], pa.int64())})
    first = take_snapshot(reader, keys=keys).base
    assert take_snapshot(reader, keys=keys).base is first  # unchanged: the same dataset object
    with t.writer() as w:
        w.put(rows([1], "g"))
    merge_all(mw.open_table(uri))
    snap = take_snapshot(reader, keys=keys)
    assert snap.base is not first and snap.base.version > first.version
    got = plan_point_lookup(snap, reader.spec, reader.schema.field_ids, keys, ["id", "v"]).to_table()
    assert sorted(got.to_pylist(), key=lambda r: r["id"]) == [{"id": 1, "v": "g1"}, {"id": 2, "v": "b2"}]


def test_lookup_snapshot_holds_only_routed_regions(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    t = mw.create_table(uri, rows(list(range(N_BASE)), "b"), "id", region_spec=mw.bucket("id", 4))
    buckets = by_bucket(t, range(N_BASE, N_BASE + 400))
    with t.writer() as w:
        w.put(rows([ks[0] for ks in buckets.values()], "g"))
    every = take_snapshot(t)
    assert len(every.regions) == 4 and every.lookup_keys is None
    key = next(iter(buckets.values()))[0]
    keys = pa.table({"id": pa.array([key], pa.int32())})  # conformed to the key type
    snap = take_snapshot(t, keys=keys)
    assert [r.region_id for r in snap.regions] == [t.region_id_for((next(iter(buckets)),))]
    assert snap.lookup_keys is not None and snap.lookup_keys.schema == t.schema.key_schema
    plan = plan_point_lookup(snap, t.spec, t.schema.field_ids, keys, ["v"])
    assert plan.to_table().to_pylist() == [{"v": f"g{key}"}]
    other = pa.table({"id": pa.array([key + 1], pa.int64())})
    with pytest.raises(RegionRoutingError):
        plan_point_lookup(snap, t.spec, t.schema.field_ids, other, ["v"])
    # A table whose spec reads a non-key column cannot route keys: every region is kept.
    assert snapshot_module.key_region_values(None, t.schema.field_ids, ["id"], other) is None


def test_region_manifest_reread_only_when_a_newer_version_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = str(tmp_path / "t")
    t = mw.create_table(uri, rows(list(range(N_BASE)), "b"), "id", region_spec=mw.unsharded())
    reader = mw.open_table(uri)
    full_reads: list[int] = []
    real = RegionManifestStore.latest

    def counted(store: RegionManifestStore) -> Any:
        full_reads.append(1)
        return real(store)

    monkeypatch.setattr(RegionManifestStore, "latest", counted)

    def generations(table: mw.Table) -> list[tuple[int, str | None]]:
        levels = take_snapshot(table).levels
        flushed = [lv for lv in levels if isinstance(lv, GenerationLevel)]
        assert len(flushed) == len(levels)
        return [(lv.generation, lv.path) for lv in flushed]

    w = t.writer()
    try:
        for step in range(4):
            for _ in range(step):  # 0, 1, 2, 3 new manifest versions (the probe batch is 2)
                w.put(rows([step], "g"))
                w.flush()
            full_reads.clear()
            got = generations(reader)
            assert len(full_reads) == (1 if step else 0)  # a newer version: the manifest is read
            assert generations(reader) == got and len(full_reads) == (1 if step else 0)  # kept
            assert got == generations(mw.open_table(uri))  # a fresh reader reads the same levels
            assert len(got) == step * (step + 1) // 2
    finally:
        w.close()


def test_lookups_on_both_backends(
    table_uri: str, table_storage_options: dict[str, str] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lookups (the base key map, kept fragment sessions, kept manifests) on a local path and on S3."""
    base = rows(list(range(N_BASE)), "b")
    t = mw.create_table(table_uri, base, "id", mw.bucket("id", 2), storage_options=table_storage_options)
    with t.writer() as w:
        w.put(rows([1, 2, N_BASE + 1], "g1-"))
        w.delete(pa.table({"id": pa.array([3], pa.int64())}))
    reader = Reader(table_uri, monkeypatch, table_storage_options)
    keys = [1, 2, 3, 4, N_BASE + 1, N_BASE + 2]
    before = reader.check(keys)
    assert before[1] == "g1-1" and 3 not in before and before[4] == "b4"
    merge_all(mw.open_table(table_uri, table_storage_options))
    assert reader.check(keys) == before
    assert gc_merged(mw.open_table(table_uri, table_storage_options))
    assert reader.check(keys) == before
    with t.writer() as w:
        w.put(rows([4], "g2-"))
    assert reader.check(keys) == {**before, 4: "g2-4"}


def test_kept_manifest_dropped_when_its_successors_were_collected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader keeps a region's manifest (version v) while v + 1 does not exist. When the region moved
    on by several versions and GC deleted v and its first successors, the kept manifest must not be
    taken for the latest (probing v + 1, v + 2 alone would find neither and return stale levels)."""
    uri = str(tmp_path / "t")
    t = mw.create_table(uri, rows(list(range(N_BASE)), "b"), "id", region_spec=mw.unsharded())
    reader = Reader(uri, monkeypatch)
    with t.writer() as w:
        w.put(rows([N_BASE], "g0-"))
        w.flush()
        assert reader.check([N_BASE, N_BASE + 1]) == {N_BASE: f"g0-{N_BASE}"}  # manifest kept
        for i in range(1, 6):  # one new manifest version per flush
            w.put(rows([N_BASE + i], f"g{i}-"))
            w.flush()
    (region,) = t.region_ids()
    store = RegionManifestStore(t.storage, region)
    (gone,) = [r.manifest_versions for r in mw.open_table(uri).gc(keep_manifest_versions=2).regions]
    assert len(gone) >= 3  # the kept version and its first two successors among them
    assert len(store.list_versions()) == 2
    want = {N_BASE + i: f"g{i}-{N_BASE + i}" for i in range(6)}
    assert reader.check(list(want)) == want
