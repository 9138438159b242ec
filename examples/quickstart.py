"""Quickstart: create a table, upsert and delete through the routed writer, query with DataFusion SQL.

Usage: python examples/quickstart.py [DIRECTORY]   (default: a temporary directory, removed afterwards)
"""

from __future__ import annotations

import sys
import tempfile

import datafusion
import pyarrow as pa

import memwal_df as mw


def main(directory: str | None = None) -> int:
    if directory is None:  # a temporary directory, removed afterwards
        with tempfile.TemporaryDirectory(prefix="memwal-quickstart-") as tmp:
            return main(tmp)
    uri = f"{directory}/events"
    schema = pa.schema([("id", pa.int64()), ("user", pa.string()), ("amount", pa.float64())])
    table = mw.create_table(uri, schema, primary_key="id", region_spec=mw.bucket("id", 4))

    with table.writer() as w:  # durable by default: put() returns once its WAL entry is stored
        w.put(
            pa.table(
                {"id": [1, 2, 3, 4], "user": ["ann", "bob", "ann", "cy"], "amount": [5.0, 7.5, 2.0, 1.0]}
            )
        )
        w.put(pa.table({"id": [2], "user": ["bob"], "amount": [8.0]}))  # an upsert replaces key 2
        w.delete([4])
    # close() flushed the MemTables into generations: every reader sees them now.

    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("events", mw.MemWalTable(uri))
    totals = ctx.sql("SELECT user, sum(amount) AS total FROM events GROUP BY user ORDER BY user").to_pylist()
    print(totals)
    table.merge()  # fold the generations into the base Lance table (what `memwal maintain` does)
    after = ctx.sql("SELECT id, amount FROM events ORDER BY id").to_pylist()
    print(after)
    expected = [{"user": "ann", "total": 7.0}, {"user": "bob", "total": 8.0}]
    return 0 if totals == expected and [r["id"] for r in after] == [1, 2, 3] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
