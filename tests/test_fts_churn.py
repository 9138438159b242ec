"""fts while the base table changes under one long-lived reader: the base's term state, kept per
fragment across base versions, gives exactly the reference BM25 (tests/support/search_oracle.py)
after upserts, deletes, NULL texts, flushes, merges (new fragments and deletion vectors), compaction,
version cleanup and GC; a new base version tokenizes only the fragments it added; deletion files
decode as Lance reads them; keys are located among a fragment's documents exactly."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.optional import not_none
from support.search_oracle import SearchLsm, assert_bm25, bm25, make_rows, terms

import memwal_df as mw
from memwal_df.format.deletion_files import deleted_offsets
from memwal_df.format.open_storage import open_storage
from memwal_df.format.tokenizer import Tokenizer
from memwal_df.jobs.maintain import cleanup_versions
from memwal_df.read.lsm.keys import KeySet
from memwal_df.read.search.fts.base_terms import BASE_TERMS, BUILT, base_parts
from memwal_df.read.search.fts.terms import KeyPositions
from memwal_df.read.search.planner import plan_fts
from memwal_df.read.search.staleness import NewerLevels

QUERIES = ["apple", "kiwi fig", "quince sloe yuzu", "date plum pear"]
Row = dict[str, Any]


def rows_with_nulls(ids: list[int], seed: int, null_every: int, str_keys: bool = False) -> pa.Table:
    """`make_rows`, with a NULL text for every id divisible by `null_every`."""
    rows = make_rows(ids, seed, str_keys)
    text = [None if i % null_every == 0 else t for i, t in zip(ids, rows["text"].to_pylist(), strict=True)]
    return rows.set_column(rows.schema.get_field_index("text"), "text", pa.array(text, pa.string()))


class Churn:
    """A table (base with NULL texts, optionally an inverted index), its writer, a dict model, and
    one reader that lives across every step."""

    def __init__(self, uri: str, indexed: bool, str_keys: bool = False) -> None:
        self.str_keys = str_keys
        base = rows_with_nulls(list(range(60)), seed=0, null_every=7, str_keys=str_keys)
        mw.create_table(uri, base, primary_key="id", region_spec=mw.bucket("id", 2))
        if indexed:
            lance.dataset(uri).create_scalar_index("text", "INVERTED", stem=False, remove_stop_words=False)
        self.lsm = SearchLsm(uri, [], create=False, str_keys=str_keys)
        self.model: dict[Any, Row] = {r["id"]: r for r in base.to_pylist()}
        self.reader = self.lsm.reader()

    def apply(self, op: tuple[Any, ...]) -> None:
        kind, table = op[0], self.lsm.table
        if kind == "put":
            rows = rows_with_nulls(sorted(set(op[1])), op[2], op[3], self.str_keys)
            self.lsm.writer.put(rows)
            self.model.update((r["id"], r) for r in rows.to_pylist())
        elif kind == "delete":
            self.lsm.delete(sorted(set(op[1])))
            for i in op[1]:
                self.model.pop(f"k{i:03d}" if self.str_keys else i, None)
        elif kind == "compact":
            lance.dataset(table.uri).optimize.compact_files(target_rows_per_fragment=op[1])
        elif kind == "cleanup":
            cleanup_versions(table, timedelta(0))
        elif kind == "gc":
            table.gc(grace=timedelta(0))
        else:
            getattr(self.lsm, kind)()

    def check(self, queries: list[str], k: int) -> None:
        for query in queries:
            got = plan_fts(self.reader, "text", query, k).to_table()
            assert_bm25(got, self.model, bm25(self.model, query), k)
        where = lambda r: r["category"] == "a"  # noqa: E731
        got = plan_fts(self.reader, "text", queries[0], k, {"filter": "category = 'a'"}).to_table()
        assert_bm25(got, self.model, bm25(self.model, queries[0], where), k)


CHURN_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"),
            st.lists(st.integers(0, 90), min_size=1, max_size=30),
            st.integers(0, 99),
            st.integers(2, 9),
        ),
        st.tuples(st.just("delete"), st.lists(st.integers(0, 90), min_size=1, max_size=10)),
        st.tuples(st.just("flush")),
        st.tuples(st.just("merge")),
        st.tuples(st.just("compact"), st.sampled_from([20, 1_000_000])),
        st.tuples(st.just("cleanup")),
        st.tuples(st.just("gc")),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=CHURN_OPS, k=st.integers(1, 40), queries=st.permutations(QUERIES), indexed=st.booleans())
def test_long_lived_reader_equals_reference_after_every_step(
    tmp_path_factory: pytest.TempPathFactory, ops: list[Any], k: int, queries: list[str], indexed: bool
) -> None:
    churn = Churn(str(tmp_path_factory.mktemp("churn") / "t"), indexed)
    try:
        churn.check(queries[:2], k)
        for op in ops:
            churn.apply(op)
            churn.check(queries[:2], k)
    finally:
        churn.lsm.close()


@pytest.mark.parametrize("str_keys", [False, True])
def test_merges_compaction_cleanup_and_gc_in_turn(tmp_path: Path, str_keys: bool) -> None:
    """A fixed history through every kind of base change, checked after each step (string keys:
    located among a fragment's documents by hash lookup)."""
    churn = Churn(str(tmp_path / "t"), indexed=True, str_keys=str_keys)
    steps: list[tuple[Any, ...]] = [
        ("put", list(range(0, 40)), 1, 3),
        ("merge",),
        ("put", list(range(30, 80)), 2, 5),
        ("delete", [1, 2, 3, 31, 79]),
        ("merge",),
        ("put", list(range(10, 20)), 3, 4),
        ("flush",),
        ("compact", 1_000_000),
        ("merge",),
        ("cleanup",),
        ("gc",),
        ("put", list(range(70, 90)), 4, 6),
        ("delete", [72, 11]),
        ("merge",),
        ("compact", 25),
        ("cleanup",),
        ("gc",),
    ]
    churn.check(QUERIES, 10)
    for step in steps:
        churn.apply(step)
        churn.check(QUERIES, 10)
        churn.check(QUERIES[2:], 200)
    churn.lsm.close()


def fragment_keys(uri: str) -> dict[int, tuple[tuple[str, ...], str | None]]:
    """Fragment id -> (data file paths, deletion file) of the latest version."""
    return {
        f.fragment_id: (tuple(d.path for d in f.metadata.files), f.deletion_file())
        for f in lance.dataset(uri).get_fragments()
    }


def test_a_new_base_version_tokenizes_only_its_new_fragments(tmp_path: Path) -> None:
    churn = Churn(str(tmp_path / "t"), indexed=False)
    uri = churn.lsm.uri
    churn.check(QUERIES, 10)  # builds the first version's state
    history: list[tuple[Any, ...]] = [
        ("put", list(range(40, 80)), 1, 3),
        ("delete", [2, 3, 41]),
        ("merge",),
        ("put", list(range(0, 20)), 2, 4),
        ("merge",),
        ("compact", 1_000_000),
    ]
    for step in history:
        before, counts = fragment_keys(uri), replace(BUILT)
        churn.apply(step)
        churn.check(QUERIES, 10)
        after = fragment_keys(uri)
        ds = lance.dataset(uri)
        new = [i for i, (files, _) in after.items() if before.get(i, ((), None))[0] != files]
        rows = sum(not_none(ds.get_fragment(i)).metadata.physical_rows for i in new)
        changed = [i for i, (_, deletion) in after.items() if deletion and before.get(i) != after[i]]
        assert BUILT.fragments - counts.fragments == len(new), step
        assert BUILT.documents - counts.documents == rows, step
        assert BUILT.deletion_files - counts.deletion_files == len(changed), step
        counts = replace(BUILT)
        churn.check(QUERIES, 10)  # the same version again: nothing read or tokenized
        assert BUILT == counts
        held = [name for name in BASE_TERMS.names(ds.uri) if name.startswith("terms:")]
        assert len(held) == len(after), "fragments the newest version no longer lists are dropped"
    churn.lsm.close()


def test_term_state_of_older_and_newer_base_versions(tmp_path: Path) -> None:
    """Fragment state built for one version serves an older one (more rows live) and a newer one."""
    churn = Churn(str(tmp_path / "t"), indexed=False)
    churn.apply(("put", list(range(0, 50)), 1, 4))
    churn.apply(("merge",))
    old = lance.dataset(churn.lsm.uri).version
    churn.apply(("delete", list(range(20, 45))))
    churn.apply(("put", list(range(5, 15)), 2, 3))
    churn.apply(("merge",))
    uri, storage = churn.lsm.uri, churn.lsm.table.storage
    no_newer = NewerLevels([], ["id"], pa.int64())
    for version in [None, old, None, old]:
        ds = lance.dataset(uri) if version is None else lance.dataset(uri, version=version)
        parts = base_parts(ds, storage, "text", Tokenizer(), no_newer)
        texts = [t for t in ds.to_table(columns=["text"]).column("text").to_pylist() if t is not None]
        assert sum(p.num_docs or 0 for p in parts) == len(texts)
        assert sum(p.total_len or 0 for p in parts) == sum(len(terms(t)) for t in texts)
        for word in ["apple", "fig"]:
            df = sum(int(p.corpus([word]).df[0]) for p in parts)
            assert df == sum(word in terms(t) for t in texts)
    churn.lsm.close()


@pytest.mark.parametrize("deleted", [[3, 0, 9], list(range(0, 6000, 2)), list(range(100, 5000))])
def test_deletion_files_decode_as_lance_reads_them(tmp_path: Path, deleted: list[int]) -> None:
    """Arrow (few deletions) and roaring bitmap (many) deletion files: the offsets Lance skips."""
    ds = lance.write_dataset(pa.table({"id": np.arange(6000)}), str(tmp_path / "d"))
    ds.delete(f"id IN ({', '.join(map(str, deleted))})")
    fragment = lance.dataset(str(tmp_path / "d")).get_fragments()[0]
    live = fragment.scanner(columns=["id"]).to_table().column("id").to_numpy()
    got = deleted_offsets(open_storage(str(tmp_path / "d")), fragment)
    np.testing.assert_array_equal(got, np.setdiff1d(np.arange(6000), live))


def test_key_positions_find_every_document_of_a_key() -> None:
    for keys in (pa.array([5, 3, 5, 1, 9]), pa.array(["e", "c", "e", "a", "i"])):
        positions = KeyPositions.of(keys)
        wanted = keys.take(pa.array([0, 3]))
        got = positions.positions(KeySet(wanted))
        assert sorted(got.tolist()) == [0, 2, 3]
        assert len(positions.positions(KeySet(pa.array([], keys.type)))) == 0
    unique = KeyPositions.of(pa.array([4, 2, 8]))
    assert not unique.duplicates
    assert unique.positions(KeySet(pa.array([8, 7, 2]))).tolist() in ([2, 1], [1, 2])
