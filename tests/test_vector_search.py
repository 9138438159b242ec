"""vector_search: exact against brute force over the deduplicated table (tests/support/reference.py oracle)
without a base index, recall and freshness with one, filters, MemTable-only tables, SQL, errors."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.optional import not_none
from support.search_oracle import DIM, HISTORY_OPS, SearchLsm, history, make_rows, nearest

import memwal_df as mw
from memwal_df.errors import InvalidConfigError
from memwal_df.read.lsm.snapshot import take_snapshot
from memwal_df.read.search.filter_stale import FilterStaleExec
from memwal_df.read.search.planner import plan_vector_search
from memwal_df.read.search.ranked import POSITION, RankedExec, TopKExec
from memwal_df.read.search.staleness import NewerLevels
from memwal_df.read.search.vector.vectors import METRICS

RNG = np.random.default_rng(7)
QUERIES = [RNG.standard_normal(DIM).astype(np.float32).tolist() for _ in range(4)]


def search(lsm: SearchLsm, query: list[float], k: int, with_writer: bool = True, **options: Any) -> pa.Table:
    return plan_vector_search(lsm.reader(with_writer), "vec", query, k, options or None).to_table()


def assert_exact(got: pa.Table, truth: dict[int, dict[str, Any]], want: list[tuple[int, float]]) -> None:
    """Same keys in the same order, same distances, and every row is the key's current row."""
    assert got.column("id").to_pylist() == [key for key, _ in want]
    np.testing.assert_allclose(got.column("_distance").to_numpy(), [d for _, d in want], rtol=1e-4, atol=1e-5)
    assert_fresh(got, truth)


def assert_fresh(got: pa.Table, truth: dict[int, dict[str, Any]]) -> None:
    for row in got.drop_columns(["_distance"]).to_pylist():
        assert row == truth[row["id"]], f"stale or deleted row returned: {row}"


@pytest.fixture
def lsm(tmp_path: Path) -> Any:
    t = SearchLsm(str(tmp_path / "t"), list(range(150)))
    history(t)
    yield t
    t.close()


@pytest.mark.parametrize("with_writer", [True, False])
@pytest.mark.parametrize("metric", ["l2", "cosine", "dot"])
def test_exact_without_base_index(lsm: SearchLsm, with_writer: bool, metric: str) -> None:
    truth = lsm.rows(with_writer)
    for q in QUERIES:
        for k in (1, 10, 400):
            got = search(lsm, q, k, with_writer, metric=metric)
            assert_exact(got, truth, nearest(truth, q, k, metric))


def test_filters_combined_with_search(lsm: SearchLsm) -> None:
    truth = lsm.rows()
    cases = {
        "category = 'a'": lambda r: r["category"] == "a",
        "category IN ('a', 'b') AND id > 20": lambda r: r["category"] in ("a", "b") and r["id"] > 20,
        "id = 27": lambda r: r["id"] == 27,  # a key updated in a MemTable: region pruning
        "id < 0": lambda r: False,
    }
    for text, where in cases.items():
        for q in QUERIES:
            assert_exact(search(lsm, q, 10, filter=text), truth, nearest(truth, q, 10, where=where))


def test_overfetch_grows_when_the_nearest_rows_are_stale(tmp_path: Path) -> None:
    """The base's 30 nearest rows to q are all moved far away in newer levels: the base's first
    candidates are all stale, and the plan must keep fetching until 10 live ones survive."""
    lsm = SearchLsm(str(tmp_path / "t"), list(range(300)))
    q = QUERIES[0]
    moved = [key for key, _ in nearest(lsm.rows(), q, 30)]
    far = pa.FixedSizeListArray.from_arrays(pa.array(np.full(30 * DIM, 100, np.float32)), DIM)
    lsm.writer.put(make_rows(moved, seed=9).set_column(3, "vec", far))
    lsm.flush()
    truth = lsm.rows()
    plan = plan_vector_search(lsm.reader(), "vec", q, 10)
    assert_exact(plan.to_table(), truth, nearest(truth, q, 10))
    base_arm = plan.children[0]
    assert isinstance(base_arm, FilterStaleExec)
    assert base_arm.fetched is not None and base_arm.fetched > 20  # grew past k * overfetch
    lsm.close()


def test_base_ivf_index_recall_and_freshness(tmp_path: Path) -> None:
    """With an IVF_PQ index on the base (behind on catch-up after a merge): recall@10 against brute
    force, no stale row, and exact distances (refined)."""
    lsm = SearchLsm(str(tmp_path / "t"), list(range(1000)))
    lance.dataset(lsm.uri).create_index("vec", "IVF_PQ", num_partitions=4, num_sub_vectors=2)
    history(lsm)
    lsm.put(list(range(1000, 1100)), seed=11)
    lsm.merge()  # merged rows land in fragments the index does not cover
    base = lance.dataset(lsm.uri)
    covered = {f for seg in base.describe_indices()[0].segments for f in seg.fragment_ids}
    assert {f.fragment_id for f in base.get_fragments()} - covered, "the index should be behind"
    truth = lsm.rows()
    recalls = []
    for q in QUERIES:
        got = search(lsm, q, 10, nprobes=4, refine_factor=5)
        assert_fresh(got, truth)
        exact = {key: d for key, d in nearest(truth, q, len(truth))}
        np.testing.assert_allclose(
            got["_distance"].to_numpy(), [exact[i] for i in got["id"].to_pylist()], rtol=1e-4
        )
        recalls.append(len(set(got["id"].to_pylist()) & {key for key, _ in nearest(truth, q, 10)}) / 10)
    assert np.mean(recalls) >= 0.8, recalls
    lsm.close()


def test_memtable_only(tmp_path: Path) -> None:
    lsm = SearchLsm(str(tmp_path / "t"), [])
    lsm.put(list(range(50)), seed=1)
    lsm.put(list(range(10, 20)), seed=2)
    lsm.delete([11, 12])
    truth = lsm.rows()
    for q in QUERIES:
        assert_exact(search(lsm, q, 10), truth, nearest(truth, q, 10))
    assert search(lsm, QUERIES[0], 10, with_writer=False).num_rows == 0
    lsm.close()


@pytest.mark.parametrize("metric", ["l2", "cosine", "dot"])
def test_exact_over_generations_that_replace_each_other(tmp_path: Path, metric: str) -> None:
    """Several unmerged generations per region, each replacing and deleting rows of the older ones,
    searched as one brute-force operator (int8 first pass for l2, float32 for the others)."""
    lsm = SearchLsm(str(tmp_path / "t"), list(range(100)))
    lsm.put(list(range(0, 60)), seed=1)
    lsm.flush()
    lsm.put(list(range(30, 90)), seed=2)
    lsm.delete([31, 32, 80, 3])
    lsm.flush()
    lsm.put(list(range(50, 70)), seed=3)
    lsm.delete([1, 2, 51])
    lsm.flush()
    lsm.put([5, 6, 52], seed=4)
    for with_writer in (True, False):
        truth = lsm.rows(with_writer)
        for q in QUERIES:
            for k in (1, 10, 200):
                got = search(lsm, q, k, with_writer, metric=metric)
                assert_exact(got, truth, nearest(truth, q, k, metric))
            got = search(lsm, q, 10, with_writer, metric=metric, filter="category <> 'b'")
            assert_exact(got, truth, nearest(truth, q, 10, metric, where=lambda r: r["category"] != "b"))
    lsm.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=HISTORY_OPS, k=st.integers(1, 30), q=st.sampled_from(QUERIES), metric=st.sampled_from(METRICS))
def test_hypothesis_histories_never_stale(
    tmp_path_factory: pytest.TempPathFactory, ops: list[Any], k: int, q: Any, metric: str
) -> None:
    lsm = SearchLsm(str(tmp_path_factory.mktemp("h") / "t"), list(range(40)))
    try:
        lsm.replay(ops)
        truth = lsm.rows()
        assert_exact(search(lsm, q, k, metric=metric), truth, nearest(truth, q, k, metric))
        assert_exact(
            search(lsm, q, k, metric=metric, filter="category <> 'b'"),
            truth,
            nearest(truth, q, k, metric, where=lambda r: r["category"] != "b"),
        )
    finally:
        lsm.close()


def test_newer_levels_exact_despite_bloom(lsm: SearchLsm) -> None:
    """The bloom pre-check never changes the answer: `stale` equals exact membership in newer levels."""
    snapshot = take_snapshot(lsm.table, writer=lsm.writer)
    levels = snapshot.levels
    newer = NewerLevels(levels, ["id"], pa.int64())
    held = set()
    for level in levels:
        held |= set(not_none(level.keys(["id"])).to_pylist())
    probe = pa.table({"id": pa.array(np.arange(-50, 400), pa.int64())})
    want = np.array([k in held for k in probe.column("id").to_pylist()])
    assert (newer.stale(probe) == want).all()  # bloom pre-check where a key set is not read yet
    for level in levels:  # every key set read
        level.key_set(["id"], pa.int64())
    assert newer._generations_union() is not None
    assert (newer.stale(probe) == want).all()  # through the union of the generations' key sets


def test_sql_results_are_relations(lsm: SearchLsm) -> None:
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", lsm.reader())
    truth = lsm.rows()
    q = QUERIES[1]
    vec = "[" + ", ".join(repr(x) for x in q) + "]"
    want = nearest(truth, q, 10, where=lambda r: r["category"] == "a")
    got = ctx.sql(
        f"SELECT * FROM vector_search('t', 'vec', {vec}, 10, named_struct('filter', 'category = ''a''', "
        "'nprobes', 4, 'metric', 'l2')) ORDER BY _distance"
    ).to_arrow_table()
    assert_exact(got, truth, want)
    sql = (
        f"SELECT s.id, t.category FROM vector_search('t', 'vec', {vec}, 20) s JOIN t ON s.id = t.id "
        "WHERE s.category = 'c' ORDER BY s.id"
    )
    rows = ctx.sql(sql).to_arrow_table().to_pylist()
    assert [r["id"] for r in rows] == sorted(
        key for key, _ in nearest(truth, q, 20) if truth[key]["category"] == "c"
    )
    lines = ctx.sql(
        f"SELECT line FROM memwal_explain_search('vector_search', 't', 'vec', {vec}, 5)"
    ).to_pandas()
    assert lines["line"][0].startswith("TopKExec: k=5") and any("FilterStaleExec" in x for x in lines["line"])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("vec", QUERIES[0], 0, None), "k must be"),
        (("vec", QUERIES[0][:3], 5, None), "needs 8 finite numbers"),
        (("vec", QUERIES[0], 5, {"nprobe": 3}), "unknown option"),
        (("vec", QUERIES[0], 5, {"metric": "hamming"}), "unknown metric"),
        (("vec", QUERIES[0], 5, {"nprobes": -1}), "positive integer"),
        (("vec", QUERIES[0], 5, {"filter": "category = "}), "in filter 'category = '"),
        (("vec", QUERIES[0], 5, {"filter": "nope = 1"}), "names column 'nope'"),
        (("vec", QUERIES[0], 5, {"filter": "category = 1"}), "column 'category' \\(string\\) with 1"),
        (("text", QUERIES[0], 5, None), "not a fixed-size list"),
        (("nope", QUERIES[0], 5, None), "no column"),
    ],
)
def test_bad_input_raises_typed_errors(lsm: SearchLsm, args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        plan_vector_search(lsm.reader(), *args)


def test_string_keys(tmp_path: Path) -> None:
    """Keys of another type: key sets, bloom pre-check and region routing by string."""
    lsm = SearchLsm(str(tmp_path / "t"), list(range(150)), str_keys=True)
    history(lsm)
    truth = lsm.rows()
    for q in QUERIES:
        assert_exact(search(lsm, q, 10), truth, nearest(truth, q, 10))
    lsm.close()


class _Arm(RankedExec):
    """A ranked arm over fixed scores; `native` ones run on the pool thread, and may fail."""

    def __init__(self, scores: list[float], native: bool, fail: bool = False) -> None:
        self.scores, self.native, self.fail, self.k = scores, native, fail, 2
        self.score, self.schema = "_distance", None
        self.thread: str | None = None

    def describe(self) -> str:
        return "_Arm"

    def top(self, n: int) -> pa.Table:
        self.thread = threading.current_thread().name
        if self.fail:
            raise OSError("the base search failed")
        best = sorted(range(len(self.scores)), key=self.scores.__getitem__)[:n]
        return pa.table({POSITION: pa.array(best, pa.int64()), "_distance": [self.scores[i] for i in best]})

    def rows(self, positions: np.ndarray) -> pa.Table:
        return pa.table({"id": pa.array([int(10 * s) for s in np.take(self.scores, positions)], pa.int64())})


def test_topk_overlaps_native_arms_and_keeps_arm_order() -> None:
    """A native arm runs on a pool thread meanwhile; the result equals the serial one (ties by arm)."""
    schema = pa.schema([("id", pa.int64()), ("_distance", pa.float32())])
    base, gen = _Arm([0.3, 0.1, 0.9], native=True), _Arm([0.1, 0.2], native=False)
    out = TopKExec([base, gen], 3, "_distance", schema).to_table()
    assert out.column("id").to_pylist() == [1, 1, 2]
    assert out.column("_distance").to_pylist() == pytest.approx([0.1, 0.1, 0.2])
    assert base.thread is not None and base.thread.startswith("memwal-ranked")
    assert gen.thread == threading.current_thread().name
    with pytest.raises(OSError, match="base search failed"):
        TopKExec([_Arm([0.1], native=True, fail=True), gen], 3, "_distance", schema).to_table()


def test_an_index_created_through_the_tables_own_dataset_object_is_used(tmp_path: Path) -> None:
    """`create_index` moves a LanceDataset object to a new version in place: the next plan still sees
    the new index (the table re-opens a moved object; index descriptions are kept per object and
    version)."""
    lsm = SearchLsm(str(tmp_path / "t"), list(range(300)))
    reader = lsm.reader(with_writer=False)
    before = "\n".join(plan_vector_search(reader, "vec", QUERIES[0], 10).explain())
    assert "refine_factor=None" in before  # no index: an exact search of the base
    ds = reader.table.dataset
    ds.create_index("vec", "IVF_PQ", num_partitions=2, num_sub_vectors=2)
    assert reader.table.dataset is ds  # the same object, now at the index's version
    after = plan_vector_search(reader, "vec", QUERIES[0], 10)
    assert "refine_factor=1" in "\n".join(after.explain())  # the index's default refine
    truth = lsm.rows(with_writer=False)
    assert_fresh(after.to_table(), truth)
    lsm.close()
