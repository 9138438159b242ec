"""The base key map carried across base versions (`memwal_df.read.base_key_map`).

1. A merge patches the previous version's map, reading only the new fragments' keys (`STATS`), and
   the patched map equals a map built from scratch.
2. Deletes, a compaction and a restore to an older version: every patched map equals a fresh build.
3. Random histories of puts, deletes, flushes, merges, compactions, version cleanups and GC with one
   long-lived reader (`MemWalTable`), compared with a dict model after every step.
"""

from __future__ import annotations

import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memwal_df as mw
from memwal_df.jobs.maintain import cleanup_versions
from memwal_df.read import base_key_map
from memwal_df.read.base_key_map import STATS, BaseKeyMap

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), ("v", pa.string())])


def rows(ids: list[int] | range, tag: str) -> pa.Table:
    ids = list(ids)
    return pa.table({"id": pa.array(ids, pa.int64()), "v": [f"{tag}{i}" for i in ids]}, schema=SCHEMA)


def assert_same_map(got: BaseKeyMap, ds: lance.LanceDataset) -> None:
    """`got` lists exactly the live rows of `ds`'s version: equal to a map built from scratch."""
    want = BaseKeyMap.build(ds, "id")
    assert got.version == want.version
    got_rows, want_rows = got.entries(), want.entries()
    np.testing.assert_array_equal(got_rows.keys, want_rows.keys)
    np.testing.assert_array_equal(got_rows.fragments, want_rows.fragments)
    np.testing.assert_array_equal(got_rows.physical, want_rows.physical)
    assert got.layout.keys() == want.layout.keys()
    for fid, fragment in want.layout.items():
        np.testing.assert_array_equal(got.layout[fid].deleted, fragment.deleted)


def lookup(table: mw.MemWalTable, keys: list[int]) -> dict[int, str]:
    out = table.to_table(columns=["id", "v"], filter=pc.field("id").isin(keys))
    got = dict(zip(out.column("id").to_pylist(), out.column("v").to_pylist(), strict=True))
    assert len(got) == out.num_rows
    return got


# ------------------------------------------------------------------------------------------------
# 1. a merge patches the map


def test_merge_patches_the_map_reading_only_new_rows(tmp_path: Path) -> None:
    t = mw.create_table(str(tmp_path / "t"), rows(range(5000), "b"), "id", region_spec=mw.bucket("id", 2))
    reader = mw.MemWalTable(t.uri)
    model = {i: f"b{i}" for i in range(5000)}
    assert lookup(reader, [1, 2, 4999, 6000]) == {k: model[k] for k in (1, 2, 4999)}
    builds = STATS.builds
    for round_ in range(3):
        upserts = [*range(round_ * 7, 5000, 397), 5000 + round_]
        with t.writer() as w:
            w.put(rows(upserts, f"r{round_}-"))
            w.flush()
        t.merge()
        model.update({k: f"r{round_}-{k}" for k in upserts})
        patches, read = STATS.patches, STATS.rows_read
        keys = [*upserts, 1, 2, 3, 4999, 6000]
        assert lookup(reader, keys) == {k: model[k] for k in keys if k in model}
        assert STATS.patches > patches and STATS.builds == builds  # patched, not built
        ds = lance.dataset(t.uri)
        new_rows = sum(f.count_rows() for f in ds.get_fragments() if f.fragment_id > 0)
        assert STATS.rows_read - read <= new_rows  # the base's first fragment is never read again
        assert_same_map(base_key_map.base_key_map(reader.table.dataset, ["id"]), ds)  # type: ignore[arg-type]
        builds = STATS.builds  # assert_same_map's own build


# ------------------------------------------------------------------------------------------------
# 2. deletes, compaction, restore


@pytest.mark.parametrize("compact_rows", [1 << 16, 0], ids=["newer-run", "folded-every-patch"])
def test_patched_maps_equal_fresh_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compact_rows: int
) -> None:
    monkeypatch.setattr(base_key_map, "_COMPACT_ROWS", compact_rows)
    uri = str(tmp_path / "base")
    lance.write_dataset(rows(range(0, 3000, 3), "b"), uri, max_rows_per_file=250)

    def upsert(ids: list[int]) -> None:
        merge = lance.dataset(uri).merge_insert("id")
        merge.when_matched_update_all().when_not_matched_insert_all().execute(rows(ids, "u"))

    steps = [
        lambda: upsert(list(range(0, 600, 2)) + [5000]),
        lambda: lance.dataset(uri).delete("id % 7 = 0"),
        lambda: lance.dataset(uri, version=2).restore(),  # the same fragments, fewer rows deleted
        lambda: upsert([3, 9, 5000, 5001]),
        lambda: lance.dataset(uri).optimize.compact_files(target_rows_per_fragment=800),
        lambda: upsert(list(range(1, 90, 4))),
        lambda: lance.dataset(uri).delete("id % 5 = 0"),
        lambda: upsert([6, 12]),
    ]
    made = base_key_map.of_version(lance.dataset(uri), "id")
    for step in steps:
        step()
        latest = lance.dataset(uri)
        made = base_key_map.of_version(latest, "id")
        assert_same_map(made, latest)
        model = {r["id"]: r["v"] for r in latest.to_table().to_pylist()}
        keys = pa.chunked_array([pa.array([*range(-3, 5005, 5), 5000, 5001], pa.int64())])
        taken = made.take(latest, keys, ["id", "v"])
        assert taken is not None
        got = dict(zip(taken.column("id").to_pylist(), taken.column("v").to_pylist(), strict=True))
        assert got == {k: model[k] for k in keys.to_pylist() if k in model}
    older = lance.dataset(uri, version=3)  # older than the newest map: built, not patched
    builds = STATS.builds
    assert_same_map(base_key_map.of_version(older, "id"), older)
    assert STATS.builds == builds + 2  # of_version's build, and assert_same_map's own


# ------------------------------------------------------------------------------------------------
# 3. random histories, one long-lived reader

_ids = st.lists(st.integers(0, 60), min_size=1, max_size=8)
_op: st.SearchStrategy[tuple[str, list[int]]] = st.one_of(
    st.tuples(st.just("put"), _ids),
    st.tuples(st.just("delete"), _ids),
    st.tuples(st.sampled_from(["flush", "merge", "compact", "cleanup", "gc"]), st.just([])),
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=st.lists(_op, min_size=1, max_size=12))
def test_long_lived_reader_matches_the_model(history: list[tuple[str, list[int]]]) -> None:
    root = tempfile.mkdtemp(prefix="memwal-keymap-")
    try:
        t = mw.create_table(str(Path(root) / "t"), rows(range(40), "b"), "id", region_spec=mw.bucket("id", 2))
        reader = mw.MemWalTable(t.uri)
        model = {i: f"b{i}" for i in range(40)}
        probe = list(range(-1, 62))
        w = t.writer(max_memtable_rows=10_000)
        try:
            for step, (op, ids) in enumerate(history):
                if op == "put":
                    w.put(rows(ids, f"s{step}-"))
                    model.update({k: f"s{step}-{k}" for k in ids})
                elif op == "delete":
                    w.delete(pa.table({"id": pa.array(ids, pa.int64())}))
                    for k in ids:
                        model.pop(k, None)
                elif op == "flush":
                    w.flush()
                elif op == "merge":
                    w.flush()
                    t.merge()
                elif op == "compact":
                    lance.dataset(t.uri).optimize.compact_files(target_rows_per_fragment=1000)
                elif op == "cleanup":
                    cleanup_versions(t, timedelta(0), keep=1)
                else:
                    t.gc(grace=timedelta(0))
                w.flush()  # the reader sees flushed generations only
                assert lookup(reader, probe) == {k: v for k, v in model.items() if k in probe}
        finally:
            w.abort()
    finally:
        shutil.rmtree(root, ignore_errors=True)
