"""Vector and full-text search in SQL: `vector_search(...)` and `fts(...)` are table functions over
every level of the table (base, flushed generations, the writer's MemTables), never returning a
stale or deleted row; their results join and filter like any table.

Usage: python examples/search_sql.py [DIRECTORY]   (default: a temporary directory, removed afterwards)
"""

from __future__ import annotations

import sys
import tempfile

import datafusion
import lance
import numpy as np
import pyarrow as pa

import memwal_df as mw

DIM = 8


def docs(ids: list[int], texts: list[str], vecs: np.ndarray) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "body": texts,
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vecs.astype(np.float32).ravel()), DIM),
        }
    )


def main(directory: str | None = None) -> int:
    if directory is None:  # a temporary directory, removed afterwards
        with tempfile.TemporaryDirectory(prefix="memwal-search-") as tmp:
            return main(tmp)
    uri = f"{directory}/docs"
    rng = np.random.default_rng(3)
    base_vecs = rng.standard_normal((300, DIM))
    base = docs(list(range(300)), [f"note {i} about rivers" for i in range(300)], base_vecs)
    table = mw.create_table(uri, base, primary_key="id", region_spec=mw.bucket("id", 2))
    lance.dataset(uri).create_scalar_index("body", "INVERTED")  # Lance's index; fts follows its tokenizer

    ctx = mw.register(datafusion.SessionContext())
    with table.writer() as w:
        ctx.register_table("docs", mw.MemWalTable(uri, writer=w))
        w.put(docs([7], ["a new note about mountains"], np.ones((1, DIM))))  # replaces id 7
        w.delete([8])
        query = "[" + ", ".join(["1.0"] * DIM) + "]"
        nearest = ctx.sql(f"SELECT id, _distance FROM vector_search('docs', 'vec', {query}, 3)").to_pylist()
        mountains = ctx.sql("SELECT id, body FROM fts('docs', 'body', 'mountain', 5)").to_pylist()
        rivers = ctx.sql(
            "SELECT count(*) AS n FROM fts('docs', 'body', 'rivers', 1000) WHERE id IN (7, 8)"
        ).to_pylist()
        filtered = ctx.sql(
            f"SELECT id FROM vector_search('docs', 'vec', {query}, 3, named_struct('filter', 'id > 100'))"
        ).to_pylist()
    print("nearest to [1, ...]:", nearest)
    print("fts 'mountain':", mountains)
    print("rows 7 and 8 among 'rivers' hits:", rivers[0]["n"])
    print("nearest with id > 100:", filtered)
    d = ((base_vecs - 1.0) ** 2).sum(1)
    d[[7, 8]] = np.inf  # 7 was replaced, 8 deleted
    expected = [7, *np.argsort(d)[:2].tolist()]  # the new id 7 is exactly the query (distance 0)
    ok = (
        [r["id"] for r in nearest] == expected
        and [r["id"] for r in mountains] == [7]  # stemming: "mountains" matches "mountain"
        and rivers[0]["n"] == 0  # neither the old version of 7 nor the deleted 8
        and all(r["id"] > 100 for r in filtered)
        and len(filtered) == 3
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
