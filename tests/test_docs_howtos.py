"""The how-tos of the docs do what they say: their Python snippets run as written (given the names
the surrounding text defines: `table`, `batch`, `replica`) and have the documented effect."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import datafusion
import numpy as np
import pyarrow as pa
import pytest

import memwal_df as mw
from memwal_df.errors import InvalidConfigError, SchemaMismatchError

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def snippet(doc: str, after: str) -> str:
    """The first Python block of docs/`doc` after the text `after`."""
    text = (DOCS / doc).read_text()
    assert after in text, f"{doc} lost {after!r}"
    block = re.search(r"```python\n(.*?)```", text[text.index(after) :], flags=re.S)
    assert block is not None, f"{doc}: no Python block after {after!r}"
    return block.group(1)


def lines(ctx: datafusion.SessionContext, sql: str) -> str:
    return "\n".join(ctx.sql(sql).to_arrow_table().column("line").to_pylist())


def rows(uri: str, **kwargs) -> dict:
    return {r["id"]: r["v"] for r in mw.MemWalTable(uri, **kwargs).to_table().to_pylist()}


def test_indexes_created_with_lance_are_used_by_a_table_registered_before(tmp_path):
    n, dim = 1_000, 16  # 16: the snippet's num_sub_vectors divides it
    vectors = pa.array(np.random.default_rng(5).standard_normal(n * dim), pa.float32())
    data = pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "category": [f"c{i % 4}" for i in range(n)],
            "text": [f"note {i} about rivers" for i in range(n)],
            "vec": pa.FixedSizeListArray.from_arrays(vectors, dim),
        }
    )
    table = mw.create_table(str(tmp_path / "t"), data, primary_key="id", region_spec=mw.bucket("id", 2))
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(table.uri))
    query = "[" + ", ".join(["0.5"] * dim) + "]"
    vector = f"memwal_explain_search('vector_search', 't', 'vec', {query}, 3)"
    fts = "memwal_explain_search('fts', 't', 'text', 'rivers', 3)"
    assert "vec_idx" not in lines(ctx, f"SELECT line FROM {vector}")

    exec(snippet("search.md", "## Indexes on the base table"), {"table": table})

    assert "vec_idx" in lines(ctx, f"SELECT line FROM {vector}")
    assert "terms=['river']" in lines(ctx, f"SELECT line FROM {fts}")  # the index's stemming tokenizer
    assert "category_idx" in lines(ctx, "SELECT line FROM memwal_explain('t', 'category = ''c1''')")
    with pytest.raises(InvalidConfigError, match="'fts', 'vector_search'"):
        mw.query(ctx, f"SELECT line FROM memwal_explain_search('knn', 't', 'vec', {query}, 3)")


def test_change_feed_batches_put_into_a_table_once_their_change_columns_are_dropped(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
    table = mw.create_table(str(tmp_path / "t"), schema, "id", region_spec=mw.bucket("id", 2))
    replica = mw.create_table(str(tmp_path / "copy"), schema, "id", region_spec=mw.bucket("id", 2))
    with table.writer() as w:
        w.put(pa.table({"id": pa.array(range(10), pa.int64()), "v": [f"a{i}" for i in range(10)]}))
        w.flush()
        w.delete([3, 4])
        w.put(pa.table({"id": pa.array([5], pa.int64()), "v": ["b5"]}))
    feed = table.changes("earliest")
    code = snippet("changes.md", "**Putting changes into a table yourself.**")
    for batch in feed:
        exec(code, {"batch": batch, "replica": replica})
    expected = {i: f"a{i}" for i in range(10) if i not in (3, 4)} | {5: "b5"}
    assert rows(replica.uri) == expected

    with pytest.raises(SchemaMismatchError, match="_change_type"), replica.writer() as w:
        w.put(table.changes("earliest").read_all())  # the change columns are not the table's


def test_a_key_given_twice_in_one_put_keeps_its_last_row(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
    first = pa.table({"id": pa.array([1, 2, 1, 3, 1, 2], pa.int64()), "v": ["a", "b", "c", "d", "e", "f"]})
    expected = {1: "e", 2: "f", 3: "d"}
    table = mw.create_table(str(tmp_path / "t"), schema, "id", region_spec=mw.bucket("id", 4))
    with table.writer() as w:
        w.put(first)
        assert rows(table.uri, writer=w) == expected
    assert rows(table.uri) == expected
    table.merge()
    assert rows(table.uri) == expected
    created = mw.create_table(str(tmp_path / "c"), first, "id", region_spec=mw.bucket("id", 4))
    assert rows(created.uri) == expected


def test_the_reading_example_runs(tmp_path):
    data = pa.table({"id": pa.array(range(200), pa.int64()), "category": [f"c{i % 3}" for i in range(200)]})
    table = mw.create_table(str(tmp_path / "t"), data, "id", region_spec=mw.bucket("id", 2))
    namespace: dict[str, Any] = {"uri": table.uri}
    exec(snippet("reading.md", "# Reading a MemWAL table"), namespace)
    assert namespace["rows"].num_rows == 99
