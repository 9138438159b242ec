"""vector_search with the base vector index behind on catch-up: the base is searched over
the fragments its index covers only, and the generations merged since the index was built ("gap
generations") through their own index or exactly, with FilterStaleExec across them.

With every IVF partition probed and a refine factor covering every row, Lance's answer over the
covered fragments is exact, so the whole plan must equal brute force over the deduplicated table
(`search_oracle.nearest`); at a low nprobes, every row must still be a current row. `explain` must
show the plan that was used, and the fall-back (plain plan, the uncovered fragments searched by
Lance) when the catch-up proof does not hold.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.search_oracle import HISTORY_OPS, SearchLsm, history, make_rows, nearest
from test_vector_search import QUERIES, assert_exact, assert_fresh

import memwal_df as mw
from memwal_df.read.lsm import levels as _levels
from memwal_df.read.lsm.levels import GenerationLevel
from memwal_df.read.search.planner import plan_vector_search
from memwal_df.read.search.staleness import NewerLevels
from memwal_df.read.search.vector import vectors
from memwal_df.read.search.vector.brute_force_knn import BruteForceKnnExec

PARTITIONS = 4
EXACT = {"nprobes": PARTITIONS, "refine_factor": 10_000}  # every partition, every row refined


def indexed_lsm(path: Path, base_ids: list[int]) -> SearchLsm:
    """A table whose base has an IVF_PQ index built before any write (a maintained index)."""
    lsm = SearchLsm(str(path / "t"), base_ids)
    lance.dataset(lsm.uri).create_index("vec", "IVF_PQ", num_partitions=PARTITIONS, num_sub_vectors=2)
    lsm.table.refresh()
    return lsm


def plan_lines(lsm: SearchLsm, q: list[float], k: int, **options: Any) -> tuple[Any, list[str]]:
    plan = plan_vector_search(lsm.reader(), "vec", q, k, options or None)
    got = plan.to_table()
    return got, plan.explain()


@pytest.fixture
def behind(tmp_path: Path) -> Any:
    """Index behind by two merges, then unflushed and unmerged writes on top (updates of keys that
    are in the gap generations too, deletes)."""
    lsm = indexed_lsm(tmp_path, list(range(600)))
    history(lsm)  # ends with unflushed writes; merge() flushes them first
    lsm.put(list(range(590, 700)), seed=11)
    lsm.merge()
    lsm.put(list(range(0, 30)) + list(range(640, 660)), seed=12)  # keys of base and of gap generations
    lsm.flush()
    lsm.put(list(range(20, 25)) + [695], seed=13)
    lsm.delete([1, 650, 696])
    yield lsm
    lsm.close()


def test_gap_generations_searched_instead_of_uncovered_fragments(behind: SearchLsm) -> None:
    truth = behind.rows()
    for q in QUERIES:
        for k in (1, 10, 50):
            got, lines = plan_lines(behind, q, k, **EXACT)
            assert_exact(got, truth, nearest(truth, q, k))
        base = next(line for line in lines if "LanceKnnExec: base" in line)
        assert "indexed fragments only" in base and "catch-up: vec_idx is behind" in base, lines
        assert sum(line.count("merged generation") for line in lines) >= 2, lines
        # A gap generation is filtered by its region's unmerged levels and its newer gap generations.
        assert any("FilterStaleExec" in a and "merged generation" in b for a, b in pairwise(lines))


def test_gap_generations_with_filters_and_low_nprobes(behind: SearchLsm) -> None:
    truth = behind.rows()
    for q in QUERIES:
        got, _ = plan_lines(behind, q, 10, filter="category = 'a'", **EXACT)
        assert_exact(got, truth, nearest(truth, q, 10, where=lambda r: r["category"] == "a"))
        got, _ = plan_lines(behind, q, 10, nprobes=1)  # approximate on the base: fresh rows only
        assert_fresh(got, truth)
        assert got.num_rows == 10


def test_fallback_when_not_provable(behind: SearchLsm) -> None:
    """Rows appended to the base outside the MemWAL: the uncovered fragments no longer hold only
    the gap generations' rows, so the plain plan searches them (Lance, flat) and says why."""
    lance.write_dataset(make_rows([900, 901], seed=5), behind.uri, mode="append")
    behind.table.refresh()
    truth = behind.rows()
    got, lines = plan_lines(behind, QUERIES[0], 10, **EXACT)
    assert_exact(got, truth, nearest(truth, QUERIES[0], 10))
    base = next(line for line in lines if "LanceKnnExec: base" in line)
    assert "indexed fragments only" not in base and "Append commit" in base, base
    assert not any("merged generation" in line for line in lines)


def test_index_up_to_date_has_no_gap(tmp_path: Path) -> None:
    lsm = indexed_lsm(tmp_path, list(range(300)))
    lsm.put(list(range(0, 20)), seed=1)
    lsm.flush()
    truth = lsm.rows()
    got, lines = plan_lines(lsm, QUERIES[1], 10, **EXACT)
    assert_exact(got, truth, nearest(truth, QUERIES[1], 10))
    base = next(line for line in lines if "LanceKnnExec: base" in line)
    assert "covers every base fragment" in base and "indexed fragments only" not in base, base
    lsm.close()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=HISTORY_OPS, k=st.integers(1, 30), q=st.sampled_from(QUERIES))
def test_hypothesis_histories_with_index_behind(
    tmp_path_factory: pytest.TempPathFactory, ops: list[Any], k: int, q: Any
) -> None:
    """Random upserts, deletes, flushes and merges after the index was built, one merge at least:
    exact and never stale, whichever plan the proof allows."""
    lsm = indexed_lsm(tmp_path_factory.mktemp("h"), list(range(600)))
    try:
        lsm.replay([*ops, ("merge",)])
        lsm.put([3, 150, 601], seed=177)  # a seed no put of `ops` has: no two rows share a vector
        truth = lsm.rows()
        got, _ = plan_lines(lsm, q, k, **EXACT)
        assert_exact(got, truth, nearest(truth, q, k))
    finally:
        lsm.close()


def test_resident_generation_rows_equal_lance_takes(behind: SearchLsm, monkeypatch: Any) -> None:
    """`take` from a generation's in-memory rows returns what a Lance take returns."""
    plan = plan_vector_search(behind.reader(), "vec", QUERIES[2], 10)
    arms = [c for a in plan.children for c in [a, *a.children]]
    level = next(
        sl.level
        for a in arms
        if isinstance(a, BruteForceKnnExec)
        for sl in a.levels
        if isinstance(sl.level, GenerationLevel)
    )
    positions = np.array([3, 0, 7, 1])
    resident = level.take(positions, ["id", "category", "vec", "text"])
    assert level.cached("resident rows:id,category,vec,text", lambda: None) is not None
    monkeypatch.setattr(_levels, "RESIDENT_BYTES", 0)  # columns in another order: not cached yet
    taken = level.take(positions, ["text", "vec", "category", "id"])
    assert level.cached("resident rows:text,vec,category,id", lambda: None) is _levels._TOO_LARGE
    assert taken.select(resident.column_names).equals(resident)


def test_long_lived_reader_across_merges_derives_masks_from_the_last_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One reader across rounds of upserts, deletes, flushes and merges with the index behind: exact
    after every round, and a gap generation's mask of rows replaced by newer generations is derived
    from its mask of the round before, probing only the generations added since."""
    lsm = indexed_lsm(tmp_path, list(range(600)))
    probed: list[int] = []

    class Recorded(NewerLevels):
        def __init__(self, levels: Any, *args: Any) -> None:
            probed.append(len(levels))
            super().__init__(levels, *args)

    monkeypatch.setattr(vectors, "NewerLevels", Recorded)
    reader = mw.MemWalTable(lsm.uri)
    try:
        for round_ in range(5):
            lsm.put(list(range(round_ * 37 % 500, round_ * 37 % 500 + 60)) + [700 + round_], seed=round_)
            lsm.delete([round_ * 5, 700 + round_ - 1])
            lsm.flush() if round_ % 2 else lsm.merge()
            truth = lsm.rows(with_writer=False)
            for q in QUERIES[:2]:
                got = plan_vector_search(reader, "vec", q, 10, EXACT).to_table()
                assert_exact(got, truth, nearest(truth, q, 10))
        assert probed and max(probed) <= 1  # one generation added per region and round
    finally:
        lsm.close()
