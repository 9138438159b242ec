"""Maintained indexes: resolution against the base, the writer's MemTable indexes (against indexes
built from the rows), generation `_indices/` that Lance opens (same centroids and codebook as the
base; Lance's LsmVectorSearchPlanner searches them), and searches over indexed levels checked against
brute force / reference BM25 (tests/support/search_oracle.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lance.mem_wal import LsmVectorSearchPlanner
from support.reference import stored_rows
from support.search_oracle import DIM, HISTORY_OPS, SCHEMA, SearchLsm, bm25, history, make_rows, nearest
from test_interop import snapshots

import memwal_df as mw
from memwal_df.format.base_manifest import read_index_section
from memwal_df.format.maintained_indexes import (
    MaintainedIndex,
    _global_buffer,
    _ivf_centroids,
    _tensor,
    resolve_maintained_indexes,
)
from memwal_df.format.open_storage import open_storage
from memwal_df.format.rows import TOMBSTONE
from memwal_df.format.tokenizer import Tokenizer
from memwal_df.read.lsm.levels import GenerationLevel
from memwal_df.read.lsm.snapshot import take_snapshot
from memwal_df.read.search.fts.global_bm25 import GlobalBM25Exec
from memwal_df.read.search.fts.terms import PairTerms, TermIndex
from memwal_df.read.search.planner import plan_fts, plan_vector_search
from memwal_df.write.memtable import MemTable

RNG = np.random.default_rng(11)
QUERIES = [RNG.standard_normal(DIM).astype(np.float32).tolist() for _ in range(4)]
FTS_QUERIES = ["apple", "kiwi fig", "pear quince sloe", "nothing"]
BASE_ROWS = 600


def indexed_lsm(path: Path, indexed_write: bool = True, metric: str = "l2") -> SearchLsm:
    """A SearchLsm whose base has IVF_PQ (`metric`), inverted and btree indexes before the writer
    opens."""
    uri = str(path / "t")
    rows = make_rows(list(range(BASE_ROWS)), 0)
    mw.create_table(uri, rows, primary_key="id", region_spec=mw.bucket("id", 2))
    ds = lance.dataset(uri)
    ds.create_index("vec", "IVF_PQ", metric=metric, num_partitions=4, num_sub_vectors=2)
    ds.create_scalar_index("text", "INVERTED", stem=False, remove_stop_words=False)
    ds.create_scalar_index("category", "BTREE")
    return SearchLsm(uri, [], indexed_write=indexed_write, create=False)


def base_index_tensors(storage: Any, version: int | None, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(IVF centroids, PQ codebook) as stored in the files of index `name`."""
    import uuid

    _, entries = read_index_section(storage, version)
    (entry,) = [e for e in entries if e.name == name]
    root = f"_indices/{uuid.UUID(bytes=entry.uuid.uuid)}"
    return (
        _ivf_centroids(_global_buffer(storage, f"{root}/index.idx", 1)),
        _tensor(_global_buffer(storage, f"{root}/auxiliary.idx", 2)),
    )


# ------------------------------------------------------------------------------------------------
# Resolution


def test_maintained_indexes_resolve_every_base_index(tmp_path: Path) -> None:
    lsm = indexed_lsm(tmp_path)
    t = lsm.table
    got = {i.name: i for i in t.maintained_indexes()}
    assert sorted(got) == ["category_idx", "text_idx", "vec_idx"]
    vec = got["vec_idx"]
    assert (vec.kind, vec.index_type, vec.metric) == ("vector", "IVF_PQ", "l2")
    centroids, codebook = base_index_tensors(t.storage, None, "vec_idx")
    assert vec.centroids is not None and vec.codebook is not None
    np.testing.assert_array_equal(vec.centroids, centroids)
    assert vec.centroids.shape[1] == DIM and vec.codebook.shape == (2, 256, DIM // 2)
    np.testing.assert_array_equal(vec.codebook.reshape(codebook.shape), codebook)
    assert got["text_idx"].params["stem"] is False and got["text_idx"].kind == "inverted"
    assert (got["category_idx"].kind, got["category_idx"].index_type) == ("scalar", "BTREE")
    # A named subset (maintain_all_indexes = false) keeps only those.
    details = t.details
    details.maintain_all_indexes = False
    details.maintained_indexes[:] = ["text_idx"]
    assert [i.name for i in resolve_maintained_indexes(details, t.dataset, t.storage)] == ["text_idx"]
    lsm.close()


def test_vector_index_without_files_is_not_maintained(tmp_path: Path) -> None:
    """Lance 14 commits an IVF_PQ index on a table too small to train PQ (200 rows) without writing
    any file: a writer then opens (the index is not maintained) and searches stay exact."""
    lsm = SearchLsm(str(tmp_path / "t"), list(range(200)))
    lance.dataset(lsm.uri).create_index("vec", "IVF_PQ", num_partitions=4, num_sub_vectors=2)
    lsm.table.refresh()
    assert [i.name for i in lsm.table.maintained_indexes()] == []
    lsm.put([3, 150, 201], seed=5)  # a new region writer resolves the maintained indexes
    truth = lsm.rows()
    q = np.ones(DIM, np.float32).tolist()
    got = plan_vector_search(lsm.reader(), "vec", q, 10).to_table()
    assert got.column("id").to_pylist() == [key for key, _ in nearest(truth, q, 10)]
    lsm.close()


def test_unsupported_vector_index_is_not_maintained(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    mw.create_table(uri, make_rows(list(range(300)), 0), primary_key="id", region_spec=mw.bucket("id", 2))
    lance.dataset(uri).create_index("vec", "IVF_HNSW_SQ", num_partitions=2)
    assert mw.Table(uri).maintained_indexes() == ()


# ------------------------------------------------------------------------------------------------
# MemTable indexes against indexes built from the same rows


BATCHES = st.lists(
    st.tuples(
        st.lists(st.integers(0, 30), min_size=1, max_size=12),
        st.integers(0, 99),
        st.booleans(),  # a delete batch (tombstones: NULL vector and text)
        st.booleans(),  # NULL texts and vectors in some rows
    ),
    min_size=1,
    max_size=6,
)


WAL_SCHEMA = SCHEMA.append(pa.field(TOMBSTONE, pa.bool_(), False))


def _batch(ids: list[int], seed: int, delete: bool, nulls: bool) -> pa.RecordBatch:
    """A MemTable batch: upserts (every third text and vector NULL with `nulls`) or tombstones."""
    rows = make_rows(ids, seed)
    n = len(ids)
    if delete:
        columns = [rows["id"], *(pa.nulls(n, f.type) for f in list(SCHEMA)[1:])]
    else:
        blank = pa.array([nulls and i % 3 == 0 for i in range(n)])
        columns = [
            pc.if_else(blank, pa.scalar(None, c.type), c) if name in ("text", "vec") else c
            for name, c in zip(rows.column_names, rows.columns, strict=True)
        ]
    arrays = [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in columns]
    return pa.RecordBatch.from_arrays([*arrays, pa.array([delete] * n)], schema=WAL_SCHEMA)


@pytest.fixture(scope="module")
def maintained(tmp_path_factory: pytest.TempPathFactory) -> tuple[MaintainedIndex, ...]:
    lsm = indexed_lsm(tmp_path_factory.mktemp("maintained"))
    lsm.close()
    return lsm.table.maintained_indexes()


@settings(max_examples=40, deadline=None)
@given(batches=BATCHES, lazily=st.booleans())
def test_memtable_indexes_equal_indexes_of_the_newest_rows(
    maintained: tuple[MaintainedIndex, ...], batches: list[Any], lazily: bool
) -> None:
    """For every term and vector, the MemTable index restricted to the newest rows equals the indexes
    built from `newest()` (the per-query build without a MemTable index), indexed per write or lazily
    at snapshot time."""
    indexes = maintained
    mt = MemTable(1, WAL_SCHEMA, ["id"], indexes)
    for ids, seed, delete, nulls in batches:
        mt.append(_batch(sorted(set(ids)), seed, delete, nulls))
        if not lazily:
            mt.indexes.catch_up(mt.batches, len(mt.batches))
            assert mt.indexes.indexed_rows == mt.num_rows
    snap = mt.snapshot()
    newest = snap.table
    assert newest.equals(mt.newest())
    tokenizer = Tokenizer.from_index_details(next(i for i in indexes if i.kind == "inverted").params)
    want = TermIndex.build(newest, "text", ["id"], tokenizer)
    terms = snap.terms("text")
    assert terms is not None
    got = PairTerms.of_memtable(terms, snap.positions, newest.column("id").combine_chunks())
    np.testing.assert_array_equal(got.doc_len, want.doc_len)
    np.testing.assert_array_equal(got.in_corpus, want.in_corpus)
    for term in [*want.vocab, "absent"]:
        (d1, f1), (d2, f2) = got.postings(term), want.postings(term)
        order = np.argsort(d1)
        np.testing.assert_array_equal(d1[order], d2)
        np.testing.assert_array_equal(f1[order], f2)
    vectors = snap.vectors("vec")
    assert vectors is not None
    at = np.arange(mt.num_rows) if snap.positions is None else snap.positions
    exact = newest.column("vec").combine_chunks()
    usable = ~newest.column(TOMBSTONE).to_numpy(zero_copy_only=False) & exact.is_valid().to_numpy(
        zero_copy_only=False
    )
    np.testing.assert_array_equal(vectors.usable[at], usable)
    for i in np.flatnonzero(usable):
        np.testing.assert_array_equal(vectors.matrix[at[i]], np.asarray(exact[int(i)].as_py(), np.float32))


def test_indexed_write_indexes_before_put_returns(tmp_path: Path) -> None:
    lsm = indexed_lsm(tmp_path)
    lsm.put(list(range(1000, 1050)), seed=1)
    lsm.put(list(range(1040, 1060)), seed=2)
    for rw in lsm.writer.writers.values():
        for mt in rw.memtables:
            assert mt.indexes and mt.indexes.indexed_rows == mt.num_rows > 0
    lsm.close()


# ------------------------------------------------------------------------------------------------
# Generations


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_flush_writes_maintained_indexes_lance_opens(tmp_path: Path, metric: str) -> None:
    lsm = indexed_lsm(tmp_path, metric=metric)
    lsm.put(list(range(1000, 1300)), seed=1)
    lsm.delete([1005, 3])
    lsm.flush()
    t = lsm.table
    base_centroids, base_codebook = base_index_tensors(t.storage, None, "vec_idx")
    base_indexes = {
        i.name: i for i in lance.dataset(lsm.uri).describe_indices() if i.name != "__lance_mem_wal"
    }
    snapshot = take_snapshot(t)
    levels = snapshot.levels
    assert levels and all(isinstance(lv, GenerationLevel) for lv in levels)
    for level in levels:
        assert isinstance(level, GenerationLevel)
        ds = level.dataset()
        assert ds is not None
        described = {i.name: i for i in ds.describe_indices()}
        assert sorted(described) == ["category_idx", "text_idx", "vec_idx"]
        for name, base_index in base_indexes.items():  # same type, metric, tokenizer settings
            assert described[name].index_type == base_index.index_type
            assert described[name].details == base_index.details
        centroids, codebook = base_index_tensors(open_storage(level.uri), None, "vec_idx")
        np.testing.assert_array_equal(centroids, base_centroids)
        np.testing.assert_array_equal(codebook, base_codebook)
        # Lance's own searches use them: exact-enough nearest (refined), and full-text.
        rows = ds.to_table(filter=f"NOT {TOMBSTONE}")
        q = np.asarray(rows["vec"][0].as_py(), np.float32)
        # refine over 20 PQ candidates: PQ alone may rank another row first (the test was flaky with 1)
        nearest_row = {"column": "vec", "q": q, "k": 1, "nprobes": 4, "refine_factor": 20, "metric": metric}
        hit = ds.to_table(nearest=nearest_row)
        assert hit["id"][0].as_py() == rows["id"][0].as_py()
        word = rows["text"][0].as_py().split()[0]
        assert ds.to_table(full_text_query=word).num_rows >= 1
    truth = lsm.rows()
    for q in QUERIES:  # every generation through its own index, exact distances (refined)
        plan = plan_vector_search(lsm.reader(), "vec", q, 10, {"nprobes": 4}, indexed_generation_rows=0)
        got = plan.to_table()
        exact = dict(nearest(truth, q, len(truth), metric))
        np.testing.assert_allclose(
            got["_distance"].to_numpy(), [exact[i] for i in got["id"].to_pylist()], rtol=1e-4, atol=1e-5
        )
    lsm.close()


def test_lance_lsm_planner_finds_rows_in_our_generations(tmp_path: Path) -> None:
    lsm = indexed_lsm(tmp_path)
    lsm.put(list(range(1000, 1200)), seed=3)
    lsm.flush()
    truth = lsm.rows()
    planner = LsmVectorSearchPlanner(lance.dataset(lsm.uri), snapshots(lsm.table), "vec")
    for key in (1000, 1077, 1199):  # rows only the generations hold
        got = planner.plan_search(pa.array(truth[key]["vec"], pa.float32()), k=1, nprobes=4).to_table()
        assert got["id"].to_pylist() == [key]
    lsm.close()


def test_generation_without_live_vectors_has_no_vector_index(tmp_path: Path) -> None:
    lsm = indexed_lsm(tmp_path)
    lsm.delete([1, 2, 3])  # tombstones only: NULL vectors
    lsm.flush()
    (level, *_) = take_snapshot(lsm.table).levels
    assert isinstance(level, GenerationLevel)
    ds = level.dataset()
    assert ds is not None
    assert sorted(i.name for i in ds.describe_indices()) == ["category_idx", "text_idx"]
    truth = lsm.rows()
    got = plan_vector_search(lsm.reader(), "vec", QUERIES[0], 5, {"nprobes": 4}).to_table()
    assert all(truth[k] is not None for k in got["id"].to_pylist())
    lsm.close()


# ------------------------------------------------------------------------------------------------
# Searches over indexed levels


def _check_searches(lsm: SearchLsm, min_recall: float, indexed_generation_rows: int = 0) -> None:
    """Vector search (generations through their own index when they have `indexed_generation_rows`
    rows) and fts: no stale row, exact distances and BM25 scores, recall@10 against brute force."""
    truth = lsm.rows()
    recalls = []
    for q in QUERIES:
        plan = plan_vector_search(
            lsm.reader(), "vec", q, 10, {"nprobes": 4}, indexed_generation_rows=indexed_generation_rows
        )
        got = plan.to_table()
        for row in got.drop_columns(["_distance"]).to_pylist():
            assert row == truth[row["id"]], f"stale or deleted row returned: {row}"
        exact = dict(nearest(truth, q, len(truth)))
        np.testing.assert_allclose(
            got["_distance"].to_numpy(), [exact[i] for i in got["id"].to_pylist()], rtol=1e-4
        )
        recalls.append(len(set(got["id"].to_pylist()) & {k for k, _ in nearest(truth, q, 10)}) / 10)
    assert np.mean(recalls) >= min_recall, recalls
    for query in FTS_QUERIES:
        got = plan_fts(lsm.reader(), "text", query, 10).to_table()
        want = bm25(truth, query)
        best = sorted(want.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
        assert len(got) == len(best)
        np.testing.assert_allclose(got["_score"].to_numpy(), [s for _, s in best], atol=1e-6)
        for row in got.drop_columns(["_score"]).to_pylist():
            assert row == truth[row["id"]]
            assert abs(want[row["id"]] - got["_score"][got["id"].to_pylist().index(row["id"])].as_py()) < 1e-6


@pytest.mark.parametrize("indexed_write", [True, False])
def test_search_over_indexed_levels(tmp_path: Path, indexed_write: bool) -> None:
    lsm = indexed_lsm(tmp_path, indexed_write)
    history(lsm)
    lsm.put(list(range(BASE_ROWS, BASE_ROWS + 200)), seed=9)
    _check_searches(lsm, min_recall=0.8)  # every generation through its own index
    _check_searches(lsm, min_recall=0.8, indexed_generation_rows=10**9)  # by brute force
    explain = "\n".join(
        plan_vector_search(lsm.reader(), "vec", QUERIES[0], 10, indexed_generation_rows=0).explain()
    )
    assert "LanceKnnExec: generation" in explain and "BruteForceKnnExec: memtable" in explain
    plan = plan_fts(lsm.reader(), "text", "kiwi", 10)
    plan.to_table()
    assert isinstance(plan, GlobalBM25Exec)
    memtable_arms = [a for a in plan.bm25_arms if a.label.startswith("memtable")]
    assert memtable_arms and all(isinstance(a.parts[0].index, PairTerms) for a in memtable_arms)
    lsm.close()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=HISTORY_OPS, indexed_write=st.booleans())
def test_hypothesis_histories_over_indexed_levels(
    tmp_path_factory: pytest.TempPathFactory, ops: list[Any], indexed_write: bool
) -> None:
    lsm = indexed_lsm(tmp_path_factory.mktemp("h"), indexed_write)
    try:
        lsm.replay(ops)
        _check_searches(lsm, min_recall=0.0)  # freshness, exact distances and scores; recall above
    finally:
        lsm.close()


def test_maintained_indexes_on_both_backends(table_uri: str, table_storage_options: Any) -> None:
    """Resolution reads the base index files and the flush builds the generation indexes through the
    table's storage (local and S3); searches over them stay exact and fresh."""
    rows = make_rows(list(range(BASE_ROWS)), 0)
    t = mw.create_table(
        table_uri,
        rows,
        primary_key="id",
        region_spec=mw.bucket("id", 2),
        storage_options=table_storage_options,
    )
    ds = lance.dataset(table_uri, storage_options=table_storage_options)
    ds.create_index("vec", "IVF_PQ", num_partitions=4, num_sub_vectors=2)
    ds.create_scalar_index("text", "INVERTED", stem=False, remove_stop_words=False)
    base_centroids, _ = base_index_tensors(t.storage, None, "vec_idx")
    with t.writer() as w:
        w.put(make_rows(list(range(300, 700)), 5))
        w.flush()
        w.put(make_rows(list(range(650, 720)), 6))
        reader = mw.MemWalTable(table_uri, storage_options=table_storage_options, writer=w)
        for level in take_snapshot(t).levels:
            assert isinstance(level, GenerationLevel)
            level_ds = level.dataset()
            assert level_ds is not None
            assert sorted(i.name for i in level_ds.describe_indices()) == ["text_idx", "vec_idx"]
            centroids, _ = base_index_tensors(open_storage(level.uri, table_storage_options), None, "vec_idx")
            np.testing.assert_array_equal(centroids, base_centroids)
        truth = stored_rows(t, [mt for rw in w.writers.values() for mt in rw.memtables])
        for q in QUERIES:
            plan = plan_vector_search(reader, "vec", q, 10, {"nprobes": 4}, indexed_generation_rows=0)
            got = plan.to_table()
            assert [truth[i] for i in got["id"].to_pylist()] == got.drop_columns(["_distance"]).to_pylist()
            exact = dict(nearest(truth, q, len(truth)))
            np.testing.assert_allclose(
                got["_distance"].to_numpy(), [exact[i] for i in got["id"].to_pylist()], rtol=1e-4
            )
        got = plan_fts(reader, "text", "kiwi", 10).to_table()
        want = sorted(bm25(truth, "kiwi").values(), reverse=True)[:10]
        np.testing.assert_allclose(got["_score"].to_numpy(), want, atol=1e-6)
