"""Test support for vector_search and fts: a table with a writer and deliberately simple references.

The references read the deduplicated table from `reference.stored_rows` (a row-by-row replay of every
level) and compute nearest neighbours and BM25 scores with plain Python over those rows; they share
no code with the search operators.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
from hypothesis import strategies as st

import memwal_df as mw
from support.jobs import merge_all
from support.reference import stored_rows

DIM = 8
WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "yuzu", "sloe", "quince"]
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("category", pa.string()),
        pa.field("text", pa.string()),
        pa.field("vec", pa.list_(pa.float32(), DIM)),
    ]
)

STR_SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False), *list(SCHEMA)[1:]])

Row = dict[str, Any]
Predicate = Callable[[Row], bool]


def make_rows(ids: list[int], seed: int, str_keys: bool = False) -> pa.Table:
    """Rows for `ids` (as strings `k007` with `str_keys`): category a/b/c, text of 1-8 words
    (Zipf-like), a random vector; seeded."""
    rng = np.random.default_rng(seed)
    n = len(ids)
    weights = 1.0 / np.arange(1, len(WORDS) + 1)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(1, 9)), p=weights / weights.sum())) for _ in ids]
    return pa.table(
        {
            "id": pa.array([f"k{i:03d}" for i in ids]) if str_keys else pa.array(ids, pa.int64()),
            "category": [["a", "b", "c"][int(x)] for x in rng.integers(0, 3, n)],
            "text": texts,
            "vec": pa.FixedSizeListArray.from_arrays(
                pa.array(rng.standard_normal(n * DIM, dtype=np.float32)), DIM
            ),
        },
        schema=STR_SCHEMA if str_keys else SCHEMA,
    )


class SearchLsm:
    """A MemWAL table (bucket regions) with an open writer; `rows()` is the deduplicated truth."""

    def __init__(
        self,
        uri: str,
        base_ids: list[int],
        seed: int = 0,
        regions: int = 2,
        str_keys: bool = False,
        indexed_write: bool = True,
        create: bool = True,
    ) -> None:
        """A new table of `base_ids` rows (`create=False`: the table at `uri`, made by the caller,
        e.g. with base indexes the writer then maintains), with a durable writer."""
        self.uri = uri
        self.str_keys = str_keys
        schema = STR_SCHEMA if str_keys else SCHEMA
        if create:
            base = make_rows(base_ids, seed, str_keys) if base_ids else schema.empty_table()
            self.table = mw.create_table(uri, base, primary_key="id", region_spec=mw.bucket("id", regions))
        else:
            self.table = mw.Table(uri)
        self.writer = self.table.writer(durable=True, indexed=indexed_write, max_memtable_rows=100_000)

    def put(self, ids: list[int], seed: int) -> None:
        self.writer.put(make_rows(ids, seed, self.str_keys))

    def delete(self, ids: list[int]) -> None:
        keys = [f"k{i:03d}" for i in ids] if self.str_keys else ids
        self.writer.delete(pa.table({"id": pa.array(keys, pa.string() if self.str_keys else pa.int64())}))

    def flush(self) -> None:
        self.writer.flush()

    def merge(self) -> None:
        self.writer.flush()
        merge_all(self.table)

    def reader(self, with_writer: bool = True) -> mw.MemWalTable:
        return mw.MemWalTable(self.uri, writer=self.writer if with_writer else None)

    def rows(self, with_writer: bool = True) -> dict[int, Row]:
        memtables = [mt for rw in self.writer.writers.values() for mt in rw.memtables] if with_writer else []
        return stored_rows(self.table, memtables)

    def close(self) -> None:
        self.writer.close()

    def replay(self, ops: list[Any]) -> None:
        """Apply a history drawn from `HISTORY_OPS`."""
        for op in ops:
            if op[0] == "put":
                self.put(sorted(set(op[1])), seed=op[2])
            elif op[0] == "delete":
                self.delete(sorted(set(op[1])))
            else:
                getattr(self, op[0])()


def history(lsm: SearchLsm) -> None:
    """Updates that move vectors and change text, deletes, flushes, a merge, then unflushed writes."""
    lsm.put(list(range(0, 40)), seed=1)
    lsm.flush()
    lsm.put(list(range(30, 60)) + list(range(150, 170)), seed=2)
    lsm.delete([5, 6, 7, 155])
    lsm.merge()
    lsm.put(list(range(20, 35)), seed=3)
    lsm.flush()
    lsm.put(list(range(25, 30)) + [171], seed=4)
    lsm.delete([45, 21])


# Random histories of upserts (ids, row seed), deletes, flushes and merges, for `SearchLsm.replay`.
HISTORY_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.integers(0, 80), min_size=1, max_size=30), st.integers(0, 99)),
        st.tuples(st.just("delete"), st.lists(st.integers(0, 80), min_size=1, max_size=10)),
        st.tuples(st.just("flush")),
        st.tuples(st.just("merge")),
    ),
    max_size=8,
)


def distance(vec: list[float], query: list[float], metric: str) -> float:
    x = np.asarray(vec, np.float64)
    q = np.asarray(query, np.float64)
    if metric == "l2":
        return float(((x - q) ** 2).sum())
    if metric == "cosine":
        return float(1 - x @ q / (np.linalg.norm(x) * np.linalg.norm(q)))
    return float(1 - x @ q)


def nearest(
    rows: dict[int, Row], query: list[float], k: int, metric: str = "l2", where: Predicate | None = None
) -> list[tuple[int, float]]:
    """(key, distance) of the k nearest rows, by brute force."""
    scored = [
        (distance(r["vec"], query, metric), key) for key, r in rows.items() if where is None or where(r)
    ]
    return [(key, d) for d, key in sorted(scored)[:k]]


def terms(text: str) -> list[str]:
    """Lance's `simple` tokenizer with lower-casing, for ASCII text: runs of letters and digits."""
    return re.findall(r"[a-z0-9]+", text.lower())


def bm25(
    rows: dict[int, Row],
    query: str,
    where: Predicate | None = None,
    tokenize: Callable[[str], list[str]] = terms,
) -> dict[int, float]:
    """BM25 score (k1 = 1.2, b = 0.75) of every row holding a query term, statistics over all rows;
    documents and query split by `tokenize`."""
    docs = {key: Counter(tokenize(r["text"])) for key, r in rows.items() if r["text"] is not None}
    n = len(docs)
    if n == 0:
        return {}
    avgdl = sum(sum(c.values()) for c in docs.values()) / n
    q = list(dict.fromkeys(tokenize(query)))
    df = {t: sum(1 for c in docs.values() if t in c) for t in q}
    out = {}
    for key, counts in docs.items():
        if where is not None and not where(rows[key]):
            continue
        length = sum(counts.values())
        score = 0.0
        for t in q:
            tf = counts.get(t, 0)
            if tf:
                idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                score += idf * tf * 2.2 / (tf + 1.2 * (1 - 0.75 + 0.75 * length / avgdl))
        if score > 0:
            out[key] = score
    return out


def assert_bm25(got: pa.Table, truth: dict[Any, Row], want: dict[Any, float], k: int) -> None:
    """The k best reference scores (ties make the keys ambiguous, not the scores), each row current,
    each score the reference score of its key."""
    best = sorted(want.values(), reverse=True)[:k]
    scores = got.column("_score").to_numpy()
    np.testing.assert_allclose(scores, best, rtol=0, atol=1e-6)
    for row, score in zip(got.drop_columns(["_score"]).to_pylist(), scores, strict=True):
        assert row == truth[row["id"]], f"stale or deleted row returned: {row}"
        assert abs(want[row["id"]] - score) <= 1e-6
