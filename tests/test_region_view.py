"""Region views patched as generations are flushed and merged hold exactly what a view read afresh
from the same generations holds, and what a dict model of the region's unmerged writes holds."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memwal_df as mw
from memwal_df.format.rows import TOMBSTONE
from memwal_df.read.lsm.levels import GenerationLevel
from memwal_df.read.lsm.snapshot import take_snapshot
from memwal_df.read.scan.region_view import ViewCache, ViewShape, build_view, region_view

STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.integers(0, 60), min_size=1, max_size=25)),
        st.tuples(st.just("delete"), st.lists(st.integers(0, 60), min_size=1, max_size=5)),
        st.tuples(st.just("flush"), st.none()),
        st.tuples(st.just("merge"), st.none()),
    ),
    min_size=1,
    max_size=14,
)


def _sorted_rows(t: pa.Table) -> list[dict]:
    return sorted(t.to_pylist(), key=lambda r: r["id"])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_patched_views_equal_fresh_views(tmp_path_factory, steps):
    uri = str(tmp_path_factory.mktemp("views") / "t")
    base = pa.table({"id": pa.array(np.arange(20), pa.int64()), "v": pa.array(np.zeros(20))})
    table = mw.create_table(uri, base, primary_key="id", region_spec=mw.bucket("id", 2))
    writer = table.writer()
    cache = ViewCache()
    shape = ViewShape.of(table.schema.schema, ["id"], pa.int64())
    pending: dict[int, tuple[float | None, bool]] = {}  # written since the last flush
    unmerged: dict[int, tuple[float | None, bool]] = {}  # flushed since the last merge: (v, tombstone)
    try:
        for i, (kind, arg) in enumerate(steps):
            if kind == "put":
                rows = pa.table({"id": pa.array(arg, pa.int64()), "v": pa.array([float(i)] * len(arg))})
                writer.put(rows)
                pending.update({k: (float(i), False) for k in arg})
            elif kind == "delete":
                writer.delete(pa.table({"id": pa.array(arg, pa.int64())}))
                pending.update({k: (None, True) for k in arg})
            else:
                writer.flush()
                unmerged.update(pending)
                pending.clear()
                if kind == "merge":
                    table.merge()
                    unmerged.clear()
            snapshot = take_snapshot(table)
            seen: dict[int, tuple[float | None, bool]] = {}
            for region in snapshot.regions:
                levels = [lv for lv in region.levels if isinstance(lv, GenerationLevel)]
                patched = region_view(uri, region.region_id, levels, shape, cache)
                fresh = build_view(region.region_id, levels, shape)
                assert _sorted_rows(patched.rows) == _sorted_rows(fresh.rows)
                assert sorted(patched.keys.to_array().to_pylist()) == sorted(
                    fresh.rows.column("id").to_pylist()
                )
                assert patched.live == sum(1 for r in fresh.rows.to_pylist() if not r[TOMBSTONE])
                for r in patched.rows.to_pylist():
                    seen[r["id"]] = (None if r[TOMBSTONE] else r["v"], r[TOMBSTONE])
            assert seen == unmerged
    finally:
        writer.close()


def test_a_flush_patches_the_view_a_merge_trims_it(tmp_path):
    uri = str(tmp_path / "t")
    base = pa.table({"id": pa.array(np.arange(10), pa.int64()), "v": pa.array(np.zeros(10))})
    table = mw.create_table(uri, base, primary_key="id", region_spec=mw.bucket("id", 1))
    writer = table.writer()
    shape, views = ViewShape.of(table.schema.schema, ["id"], pa.int64()), ViewCache()

    def view():
        (region,) = take_snapshot(table).regions
        levels = [lv for lv in region.levels if isinstance(lv, GenerationLevel)]
        return region_view(uri, region.region_id, levels, shape, views)

    try:
        for keys in ([1, 2], [2, 3], [4]):
            writer.put(pa.table({"id": pa.array(keys, pa.int64()), "v": pa.array([1.0] * len(keys))}))
            writer.flush()
            assert sorted(view().rows.column("id").to_pylist()) == sorted(
                {1, 2, 3, 4} & set(range(1, max(keys) + 1))
            )
        assert (views.builds, views.advances) == (1, 2)
        table.merge()
        assert view().rows.num_rows == 0 and (views.builds, views.advances) == (1, 3)
    finally:
        writer.close()


def test_a_base_too_large_to_index_is_anti_joined_by_key(tmp_path, monkeypatch):
    """Both base plans (row mask from the key index, anti-join by key) return the model's rows."""
    from memwal_df.read.lsm import base_key_index

    uri = str(tmp_path / "t")
    base = pa.table({"id": pa.array(np.arange(300), pa.int64()), "v": pa.array(np.zeros(300))})
    table = mw.create_table(uri, base, primary_key="id", region_spec=mw.bucket("id", 2))
    writer = table.writer()
    model = {i: 0.0 for i in range(300)}
    try:
        for step, keys in enumerate(([1, 5, 400], [5, 6, 401], [7, 1])):
            writer.put(pa.table({"id": pa.array(keys, pa.int64()), "v": pa.array([step + 1.0] * len(keys))}))
            model.update({k: step + 1.0 for k in keys})
            writer.flush()
            if step == 1:
                table.merge()  # the base gets deletion files and a new fragment
        writer.delete(pa.table({"id": pa.array([6, 2], pa.int64())}))
        for k in (6, 2):
            model.pop(k)
        writer.put(pa.table({"id": pa.array([9], pa.int64()), "v": pa.array([9.0])}))
        model[9] = 9.0
        for limit in (base_key_index.MAX_INDEXED_BASE_ROWS, 0):
            monkeypatch.setattr(base_key_index, "MAX_INDEXED_BASE_ROWS", limit)
            for reader in (mw.MemWalTable(uri, writer=writer),):
                got = reader.to_table().sort_by("id")
                assert (
                    dict(zip(got.column("id").to_pylist(), got.column("v").to_pylist(), strict=True)) == model
                )
                assert reader.to_table(columns=[]).num_rows == len(model)
                plan = reader.explain()
                assert ("MaskedScanExec" in plan) == (limit > 0) and ("AntiJoinScanExec" in plan) == (
                    limit == 0
                )
    finally:
        writer.close()
