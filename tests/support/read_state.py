"""Test support for read state carried across versions: a narrow table with text and vectors, and one
battery of SQL reads checked against a dict model (key -> row).

`check_reads` runs every query shape a cache of derived read state could answer (row counts, scans
with and without the key, filters, key ranges, top-k, aggregates, `LIMIT`, point lookups, `fts`,
`vector_search`) through one DataFusion context against the model; the references are plain Python
over the model (BM25 and brute-force nearest neighbours from `search_oracle`).
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import datafusion
import lance
import numpy as np
import pyarrow as pa

import memwal_df as mw
from support.search_oracle import assert_bm25, bm25, nearest

DIM = 4
WORDS = ["apple", "fig", "kiwi", "pear"]  # a tiny vocabulary: terms collide across levels
CATEGORIES = ["a", "b", "c"]
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("category", pa.string()),
        pa.field("value", pa.float64()),
        pa.field("text", pa.string()),
        pa.field("vec", pa.list_(pa.float32(), DIM)),
    ]
)
QUERY_VECTOR = [0.5, -0.5, 1.0, 0.0]

Row = dict[str, Any]
Model = dict[int, Row]


def row(
    key: int, category: str | None, value: float | None, text: str | None, vec: list[float] | None
) -> Row:
    return {"id": key, "category": category, "value": value, "text": text, "vec": vec}


def seeded_row(key: int, seed: int) -> Row:
    """A row whose every value is exact in float32 and whose sums are exact in float64."""
    rng = random.Random(seed * 1_000_003 + key)
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
    vec = [rng.randint(-4, 4) / 2 for _ in range(DIM)]
    return row(key, rng.choice(CATEGORIES), rng.randint(-8, 8) / 4, words, vec)


def to_table(rows: list[Row]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def create(uri: str, regions: int, base: list[Row]) -> mw.Table:
    return mw.create_table(uri, to_table(base), "id", region_spec=mw.bucket("id", regions))


def add_base_indexes(uri: str) -> None:
    """A BTREE on the key and an INVERTED index on the text (tokenized as `search_oracle.terms`)."""
    ds = lance.dataset(uri)
    ds.create_scalar_index("id", "BTREE")
    lance.dataset(uri).create_scalar_index("text", "INVERTED", stem=False, remove_stop_words=False)


def add_vector_index(uri: str) -> bool:
    """An IVF_FLAT index on the vectors with one partition, so that a search probes every indexed row
    and its refined distances are exact; False (no index) while the base has no vector to train on."""
    ds = lance.dataset(uri)
    if not ds.count_rows("vec IS NOT NULL"):
        return False
    ds.create_index("vec", "IVF_FLAT", num_partitions=1)
    return True


def sql(ctx: datafusion.SessionContext, query: str) -> list[Row]:
    return ctx.sql(query).to_arrow_table().to_pylist()


def _nulls_last(v: Any) -> tuple[bool, Any]:
    return (v is None, v)


def _group_by_category(model: Model) -> dict[Any, tuple[int, float | None]]:
    groups: dict[Any, list[float | None]] = defaultdict(list)
    for r in model.values():
        groups[r["category"]].append(r["value"])
    return {
        c: (len(vs), sum(v for v in vs if v is not None) if any(v is not None for v in vs) else None)
        for c, vs in groups.items()
    }


def check_scans(ctx: datafusion.SessionContext, name: str, model: Model, rng: random.Random) -> None:
    """Counts, scans, projections, filters, key ranges, top-k, aggregates and LIMIT of table `name`."""
    rows = [model[k] for k in sorted(model)]
    assert sql(ctx, f"SELECT count(*) AS n FROM {name}") == [{"n": len(model)}], "count(*)"
    category = rng.choice(CATEGORIES)
    want = sum(1 for r in rows if r["category"] == category)
    assert sql(ctx, f"SELECT count(*) AS n FROM {name} WHERE category = '{category}'") == [{"n": want}]
    assert sql(ctx, f"SELECT * FROM {name} ORDER BY id") == rows, "SELECT *"
    assert sorted(r["id"] for r in sql(ctx, f"SELECT id FROM {name}")) == sorted(model), "SELECT id"
    got_values = sorted((r["value"] for r in sql(ctx, f"SELECT value FROM {name}")), key=_nulls_last)
    assert got_values == sorted((r["value"] for r in rows), key=_nulls_last), "SELECT value"
    x = rng.randint(-8, 8) / 4
    below = sql(ctx, f"SELECT * FROM {name} WHERE value < {x} ORDER BY id")
    assert below == [r for r in rows if r["value"] is not None and r["value"] < x], f"value < {x}"
    lo = rng.randint(0, 30)
    ranged = sql(ctx, f"SELECT * FROM {name} WHERE id >= {lo} AND id < {lo + 8} ORDER BY id")
    assert ranged == [r for r in rows if lo <= r["id"] < lo + 8], f"key range [{lo}, {lo + 8})"
    k = rng.randint(1, 6)
    top = sql(ctx, f"SELECT * FROM {name} ORDER BY value, id LIMIT {k}")
    assert top == sorted(rows, key=lambda r: (*_nulls_last(r["value"]), r["id"]))[:k], "ORDER BY LIMIT"
    groups = sql(ctx, f"SELECT category, count(*) AS n, sum(value) AS s FROM {name} GROUP BY category")
    assert {g["category"]: (g["n"], g["s"]) for g in groups} == _group_by_category(model), "GROUP BY"
    limited = sql(ctx, f"SELECT * FROM {name} LIMIT {k}")
    assert len(limited) == min(k, len(model)), "LIMIT"
    assert all(model.get(r["id"]) == r for r in limited), "LIMIT returned a row the model does not hold"


def check_lookups(ctx: datafusion.SessionContext, name: str, model: Model, rng: random.Random) -> None:
    """Point lookups of present and absent keys."""
    absent = [k for k in range(-2, max(model, default=0) + 3) if k not in model]
    probes = rng.sample(sorted(model), min(2, len(model))) + rng.sample(absent, 1)
    for key in probes:
        got = sql(ctx, f"SELECT * FROM {name} WHERE id = {key}")
        assert got == ([model[key]] if key in model else []), f"lookup of {key}"
    got = sql(ctx, f"SELECT * FROM {name} WHERE id IN ({', '.join(map(str, probes))}) ORDER BY id")
    assert got == [model[k] for k in sorted(probes) if k in model], f"lookup of {probes}"


def check_search(ctx: datafusion.SessionContext, name: str, model: Model, rng: random.Random) -> None:
    """fts against the reference BM25 over the model; vector_search against brute force (the table
    has no vector index, or `add_vector_index`'s, through which the search is exact too)."""
    word = rng.choice(WORDS)
    for k in (3, 100):
        got = ctx.sql(f"SELECT * FROM fts('{name}', 'text', '{word}', {k}) ORDER BY _score DESC")
        assert_bm25(got.to_arrow_table(), model, bm25(model, word), k)
    with_vec = {key: r for key, r in model.items() if r["vec"] is not None}
    query = ", ".join(map(str, QUERY_VECTOR))
    for k in (3, 100):
        hits = sql(ctx, f"SELECT * FROM vector_search('{name}', 'vec', [{query}], {k}) ORDER BY _distance")
        want = nearest(with_vec, QUERY_VECTOR, k)
        np.testing.assert_allclose([r["_distance"] for r in hits], [d for _, d in want], atol=1e-6)
        exact = dict(nearest(with_vec, QUERY_VECTOR, len(with_vec)))
        for r in hits:
            distance = r.pop("_distance")
            assert r == model[r["id"]], f"stale or deleted row from vector_search: {r}"
            assert abs(distance - exact[r["id"]]) <= 1e-6


def check_reads(ctx: datafusion.SessionContext, name: str, model: Model, seed: int) -> int:
    """Every read shape of table `name` equals `model`; `seed` picks the probes (categories, bounds,
    keys, words). Returns the rows compared by the full scan (the model's size)."""
    rng = random.Random(seed)
    check_scans(ctx, name, model, rng)
    check_lookups(ctx, name, model, rng)
    check_search(ctx, name, model, rng)
    return len(model)
