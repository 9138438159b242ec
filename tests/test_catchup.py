"""Index catch-up aware scan plans (`memwal_df.read.scan.catchup`): exact results, the expected plan, and the
fall-backs.

Histories are built with the real writer and the test merger (`support.jobs`), with base scalar
indexes created through Lance, which records `index_catchup` itself when it commits an index (a copy
of the merge progress; `optimize_indices` catches an index up). Every query is compared with the
dict model and the ROW_NUMBER oracle of `test_dataset` (or, where the history has writes outside the
MemWAL that the oracle cannot see, with the model alone), and the plan `explain` shows is checked: the
fragments the index does not cover are scanned or not, and why.
"""

from __future__ import annotations

import datetime
import shutil
from collections.abc import Callable, Iterator
from typing import Any, Literal

import datafusion
import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.jobs import flushed_generations, gc_merged, merge_all, merge_region
from support.optional import not_none
from test_dataset import (
    INT,
    INT_TRUNCATE,
    Lsm,
    base_rows,
    check_both_views,
    make_row,
    queries_for,
    stage_gen1,
    stage_gen2,
    stage_memtable,
)

import memwal_df as mw
from memwal_df.errors import MissingGenerationError
from memwal_df.format import checksums, memwal_index
from memwal_df.read.scan.anti_join_scan import AntiJoinScanExec
from memwal_df.read.scan.dedup import DeduplicateExec
from memwal_df.read.scan.masked_scan import MaskedScanExec

FILTER = pc.field("v") < 40


def index(lsm: Lsm, column: str, kind: Literal["BTREE", "BITMAP"] = "BTREE") -> None:
    lance.dataset(lsm.uri).create_scalar_index(column, kind)
    lsm.table.refresh()


def _generation_datasets(lsm: Lsm) -> Iterator[lance.LanceDataset]:
    """Every flushed generation still stored; the checksum sidecar of each is written again after the
    caller changed it (as the writer would have written it with those files)."""
    for region_id in lsm.table.region_ids():
        for _, path in flushed_generations(lsm.table, region_id):
            if lsm.table.storage.list_dir(path):
                yield lance.dataset(lsm.table.storage.child_uri(path))
                checksums.write_checksums(lsm.table.storage, path)


def index_generations(lsm: Lsm, column: str = "v") -> None:
    """A btree on `column` in every flushed generation that has none (the writer builds the maintained
    indexes it resolved when it opened; this covers generations written before an index existed)."""
    for ds in _generation_datasets(lsm):
        if not any(column in d.field_names for d in ds.describe_indices()):
            ds.create_scalar_index(column, "BTREE")


def drop_generation_indexes(lsm: Lsm, column: str = "v") -> None:
    """Generations without an index on `column`, as a writer that did not maintain it writes them."""
    for ds in _generation_datasets(lsm):
        for d in ds.describe_indices():
            if column in d.field_names:
                ds.drop_index(d.name)


def explain(lsm: Lsm, flt: Any = FILTER) -> str:
    return mw.MemWalTable(lsm.uri).explain(flt)


def base_fragments(lsm: Lsm) -> set[int]:
    return {f.fragment_id for f in lance.dataset(lsm.uri).get_fragments()}


def planned(lsm: Lsm, flt: Any = FILTER) -> tuple[set[int], set[tuple[Any, int]]]:
    """(base fragments the query scans, (region, generation) of the gap levels it reads)."""
    nodes = [f.partition.make(["id"]) for f in mw.MemWalTable(lsm.uri).get_fragments(flt)]
    scanned = {i for n in nodes if isinstance(n, AntiJoinScanExec | MaskedScanExec) for i in n.fragment_ids}
    gap = {
        (n.region.region_id, lv.generation)
        for n in nodes
        if isinstance(n, DeduplicateExec) and n.gap
        for lv in n.region.levels[-n.gap :]
    }
    return scanned, gap


def behind(tmp_path: Any, base: bool = True) -> Lsm:
    """Indexes on `v` (btree) and `cat` (bitmap) built, then two generations merged in every region and
    one more in one region (index catch-up behind by different gaps per region), then an unmerged
    generation and a MemTable on top."""
    lsm = Lsm(str(tmp_path / "t"), INT, base_rows(INT) if base else [])
    index(lsm, "v")
    index(lsm, "cat", "BITMAP")
    stage_gen1(lsm)
    lsm.flush()
    stage_gen2(lsm)
    lsm.flush()
    merge_all(lsm.table)
    stage_memtable(lsm)
    lsm.flush()
    merge_region(lsm.table, lsm.table.region_ids()[0])
    index_generations(lsm, "v")
    index_generations(lsm, "cat")
    lsm.put_values([1, 2, 50, 70], lambda i: float(i) + 0.5)
    return lsm


def merged_gens(lsm: Lsm) -> set[tuple[Any, int]]:
    """(region, generation) of every merged generation."""
    lsm.table.refresh()
    merged = memwal_index.merged_generations(lsm.table.details)
    return {(r, g) for r, top in merged.items() for g in range(1, top + 1)}


def test_index_behind_merges_reads_the_gap_generations_instead(tmp_path):
    lsm = behind(tmp_path)
    try:
        assert memwal_index.index_catchup(lsm.table.details) == {}  # built before any merge
        assert len(base_fragments(lsm)) > 1
        for flt in (FILTER, pc.field("cat") == "z", (pc.field("v") > 3) & (pc.field("s") < "v3")):
            scanned, gap = planned(lsm, flt)
            assert scanned == {0}  # the fragment the indexes were built on; the others hold gap rows
            assert gap == merged_gens(lsm)
        ctx = mw.register(datafusion.SessionContext())
        ctx.register_table("t", mw.MemWalTable(lsm.uri))
        sql = "SELECT * FROM memwal_explain('t', 'v < 40 AND cat = ''a''')"
        plan = "\n".join(ctx.sql(sql).to_arrow_table().column("line").to_pylist())
        assert "is behind: generations" in plan and "then merged, not in " in plan, plan
        check_both_views(lsm, queries_for(INT))
    finally:
        lsm.abort()


def test_index_that_covers_nothing_reads_no_base_fragment(tmp_path):
    lsm = behind(tmp_path, base=False)
    try:
        assert planned(lsm) == (set(), merged_gens(lsm))
        check_both_views(lsm, queries_for(INT))
    finally:
        lsm.abort()


def test_index_caught_up_scans_the_base_through_it(tmp_path):
    lsm = behind(tmp_path)
    try:
        lance.dataset(lsm.uri).optimize.optimize_indices()
        lsm.table.refresh()
        merged = memwal_index.merged_generations(lsm.table.details)
        assert memwal_index.index_catchup(lsm.table.details)["v_idx"] == merged  # recorded by Lance
        assert planned(lsm) == (base_fragments(lsm), set())
        assert "v_idx covers every base fragment" in explain(lsm)
        check_both_views(lsm, queries_for(INT, more=False))
    finally:
        lsm.abort()


def test_filters_without_an_indexed_column_get_the_plain_plan(tmp_path):
    lsm = behind(tmp_path)
    try:
        for flt in (
            None,
            pc.field("s") >= "v100",
            pc.field("id") > 3,
            (pc.field("v") < 3) | (pc.field("id") > 3),
        ):
            assert planned(lsm, flt) == (base_fragments(lsm), set())
    finally:
        lsm.abort()


def test_pruned_regions_read_no_gap_generation(tmp_path):
    """Region pruning (truncate regions) still applies: only the matching region's gap levels are read."""
    lsm = Lsm(str(tmp_path / "t"), INT_TRUNCATE, base_rows(INT_TRUNCATE))
    try:
        index(lsm, "id")
        stage_gen1(lsm)
        lsm.flush()
        merge_all(lsm.table)
        index_generations(lsm, "id")
        scanned, gap = planned(lsm, (pc.field("id") >= 40) & (pc.field("id") < 44))
        assert scanned == {0} and len({r for r, _ in gap}) == 1 and len(merged_gens(lsm)) > 1
        queries = ["SELECT * FROM {t} WHERE id >= 40 AND id < 44", "SELECT * FROM {t} WHERE id < 5"]
        check_both_views(lsm, queries)
    finally:
        lsm.abort()


# ---------------------------------------------------------------------------------------------------------
# Fall-backs: whatever cannot be proven exact scans every base fragment
# ---------------------------------------------------------------------------------------------------------


def assert_plain_plan(lsm: Lsm, reason: str) -> None:
    assert planned(lsm) == (base_fragments(lsm), set())
    plan = explain(lsm)
    assert reason in plan and "plain plan" in plan, plan


def check_against_model(lsm: Lsm) -> None:
    """Filtered scans equal the model (for histories with writes the ROW_NUMBER oracle cannot see)."""
    table = mw.MemWalTable(lsm.uri)
    model = lsm.model_table(with_writer=False)
    for flt in (FILTER, pc.field("v") >= 100, pc.field("cat") == "z", pc.field("v").is_null()):
        got = table.to_table(filter=flt).sort_by("id")
        want = model.filter(flt).sort_by("id")
        assert got.to_pylist() == want.to_pylist(), flt


def merged_history(tmp_path: Any, maintained: list[str] | None = None, index_gens: bool = True) -> Lsm:
    lsm = Lsm(str(tmp_path / "t"), INT, base_rows(INT))
    if maintained is not None:  # the table again, with an explicit maintained-index list
        shutil.rmtree(lsm.uri)
        data = pa.Table.from_pylist(base_rows(INT), schema=INT.schema)
        lsm.table = mw.create_table(
            lsm.uri, data, primary_key="id", region_spec=INT.spec(), maintained_indexes=maintained
        )
    index(lsm, "v")
    stage_gen1(lsm)
    lsm.flush()
    stage_gen2(lsm)
    lsm.close()
    merge_all(lsm.table)
    if index_gens:
        index_generations(lsm)
    else:
        drop_generation_indexes(lsm)
    return lsm


def test_append_outside_the_memwal_falls_back(tmp_path):
    lsm = merged_history(tmp_path)
    row = make_row(INT, 500, 1.0)
    lance.write_dataset(pa.Table.from_pylist([row], schema=INT.schema), lsm.uri, mode="append")
    lsm.model[500] = lsm.flushed[500] = row
    assert_plain_plan(lsm, "is a Append commit")
    check_against_model(lsm)


def test_delete_outside_the_memwal_falls_back(tmp_path):
    """A row of a gap generation deleted from the base by hand: reading the generation would bring it
    back, so the row counts of the unindexed fragments must disagree and the plan fall back."""
    lsm = merged_history(tmp_path)
    lance.dataset(lsm.uri).delete("id = 45 OR id = 20")  # both newest in gap generations
    for k in (45, 20):
        lsm.model.pop(k, None)
        lsm.flushed.pop(k, None)
    assert_plain_plan(lsm, "live rows, the gap generations")
    check_against_model(lsm)


def test_gap_generations_without_an_index_fall_back(tmp_path):
    """Without an index on the column a gap generation would be scanned whole: the plain plan is cheaper."""
    lsm = merged_history(tmp_path, index_gens=False)
    assert_plain_plan(lsm, "has no index on v")
    check_against_model(lsm)


def test_index_that_is_not_maintained_falls_back(tmp_path):
    lsm = merged_history(tmp_path, maintained=[])
    assert_plain_plan(lsm, "not a maintained index")
    check_against_model(lsm)


def test_collected_gap_generation_falls_back(tmp_path):
    lsm = merged_history(tmp_path)
    assert gc_merged(lsm.table)
    assert_plain_plan(lsm, "garbage-collected")
    check_against_model(lsm)


def test_history_cleaned_up_falls_back(tmp_path):
    """Old versions removed (`cleanup_old_versions`): the commits since the index was built cannot be
    checked any more."""
    lsm = merged_history(tmp_path)
    ds = lance.dataset(lsm.uri)
    ds.cleanup_old_versions(older_than=datetime.timedelta(0), delete_unverified=True)
    assert_plain_plan(lsm, "cannot be read")
    check_against_model(lsm)


def test_catchup_not_matching_the_index_build_falls_back(tmp_path):
    """An `index_catchup` entry claiming less than the merge progress the index was built from."""
    lsm = merged_history(tmp_path)
    lance.dataset(lsm.uri).optimize.optimize_indices()  # caught up: catch-up = merge progress
    lsm.open_writer()
    stage_memtable(lsm)
    lsm.close()
    merge_all(lsm.table)
    details, _ = not_none(memwal_index.read_details(lsm.uri))
    progress = next(p for p in details.index_catchup if p.index_name == "v_idx")
    for c in progress.caught_up_generations:
        c.generation -= 1
    memwal_index.replace_details(lsm.uri, details, lance.dataset(lsm.uri).version)
    lsm.table.refresh()
    assert_plain_plan(lsm, "recorded catch-up is not the merge progress")
    check_against_model(lsm)


def test_gap_generation_collected_after_planning_is_an_error_then_planned_around(tmp_path):
    lsm = merged_history(tmp_path)
    table = mw.MemWalTable(lsm.uri)
    fragments = table.get_fragments(FILTER)
    assert planned(lsm)[1]
    assert gc_merged(lsm.table)  # the base version does not change: the cached proof stays valid
    with pytest.raises(MissingGenerationError):
        for f in fragments:
            list(f.scanner(filter=FILTER).to_batches())
    assert_plain_plan(lsm, "was garbage-collected")  # the next query plans around it
    check_against_model(lsm)


# ---------------------------------------------------------------------------------------------------------
# Random histories
# ---------------------------------------------------------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.integers(0, 60), min_size=1, max_size=12), st.integers(0, 80)),
        st.tuples(st.just("delete"), st.lists(st.integers(0, 60), min_size=1, max_size=6), st.just(0)),
        st.tuples(st.sampled_from(["flush", "merge", "merge one", "catch up"]), st.just([]), st.just(0)),
    ),
    min_size=1,
    max_size=14,
)
RANDOM_FILTERS = [FILTER, pc.field("v") >= 30, pc.field("v") == 7.0, pc.field("v").isin([1.0, 44.0, 60.0])]


def _shifted(value: int) -> Callable[[int], float]:
    return lambda i: float((i + value) % 80)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_histories_match_the_model(tmp_path_factory, ops):
    lsm = Lsm(str(tmp_path_factory.mktemp("h") / "t"), INT, base_rows(INT, 30))
    try:
        index(lsm, "v")
        for op, ids, value in ops:
            if op == "put":
                lsm.put_values(ids, _shifted(value))
            elif op == "delete":
                lsm.delete(ids)
            elif op == "flush":
                lsm.flush()
                index_generations(lsm)
            elif op == "catch up":
                lance.dataset(lsm.uri).optimize.optimize_indices()
            elif op == "merge":
                lsm.flush()
                index_generations(lsm)
                merge_all(lsm.table)
            else:  # merge one region: catch-up gaps differ between regions
                lsm.flush()
                index_generations(lsm)
                for region in lsm.table.region_ids()[:1]:
                    merge_region(lsm.table, region)
            table = mw.MemWalTable(lsm.uri)
            model = lsm.model_table(with_writer=False)
            for flt in RANDOM_FILTERS:
                got = table.to_table(filter=flt).sort_by("id").to_pylist()
                assert got == model.filter(flt).sort_by("id").to_pylist(), (op, flt, table.explain(flt))
    finally:
        lsm.abort()
