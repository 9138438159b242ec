"""Point lookups in the base through the base key index carried across base versions
(`memwal_df.read.lsm.base_key_index`; tests/test_base_keys.py checks the index itself against Lance).

1. A merge patches the previous version's index, reading only the new fragments' keys (`BASE_KEYS`
   counters), and lookups return the model's rows.
2. Random histories of puts, deletes, flushes, merges, compactions, version cleanups and GC with one
   long-lived reader (`MemWalTable`), compared with a dict model after every step.
"""

from __future__ import annotations

import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memwal_df as mw
from memwal_df.jobs.maintain import cleanup_versions
from memwal_df.read.lsm.base_key_index import BASE_KEYS

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), ("v", pa.string())])


def rows(ids: list[int] | range, tag: str) -> pa.Table:
    ids = list(ids)
    return pa.table({"id": pa.array(ids, pa.int64()), "v": [f"{tag}{i}" for i in ids]}, schema=SCHEMA)


def lookup(table: mw.MemWalTable, keys: list[int]) -> dict[int, str]:
    out = table.to_table(columns=["id", "v"], filter=pc.field("id").isin(keys))
    got = dict(zip(out.column("id").to_pylist(), out.column("v").to_pylist(), strict=True))
    assert len(got) == out.num_rows
    return got


# ------------------------------------------------------------------------------------------------
# 1. a merge patches the index


def test_merge_patches_the_index_reading_only_new_rows(tmp_path: Path) -> None:
    t = mw.create_table(str(tmp_path / "t"), rows(range(5000), "b"), "id", region_spec=mw.bucket("id", 2))
    reader = mw.MemWalTable(t.uri)
    model = {i: f"b{i}" for i in range(5000)}
    assert lookup(reader, [1, 2, 4999, 6000]) == {k: model[k] for k in (1, 2, 4999)}
    builds = BASE_KEYS.builds
    for round_ in range(3):
        upserts = [*range(round_ * 7, 5000, 397), 5000 + round_]
        with t.writer() as w:
            w.put(rows(upserts, f"r{round_}-"))
            w.flush()
        t.merge()
        model.update({k: f"r{round_}-{k}" for k in upserts})
        patches, read = BASE_KEYS.advances, BASE_KEYS.rows_read
        keys = [*upserts, 1, 2, 3, 4999, 6000]
        assert lookup(reader, keys) == {k: model[k] for k in keys if k in model}
        assert BASE_KEYS.advances > patches and BASE_KEYS.builds == builds  # patched, not built
        ds = lance.dataset(t.uri)
        new_rows = sum(f.count_rows() for f in ds.get_fragments() if f.fragment_id > 0)
        assert BASE_KEYS.rows_read - read <= new_rows  # the base's first fragment is never read again


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
    root = tempfile.mkdtemp(prefix="memwal-keyindex-")
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
