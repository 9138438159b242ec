"""Serve a table over Arrow Flight SQL and use it from two clients: one ingests and deletes, the
other reads every acknowledged write at once (no flush), including through vector search.

    python examples/serve.py [DIRECTORY]

Needs the ADBC Flight SQL driver: pip install adbc-driver-flightsql adbc-driver-manager
"""

from __future__ import annotations

import sys
import tempfile
import warnings

import adbc_driver_flightsql.dbapi as flightsql
import pyarrow as pa

import memwal_df as mw
from memwal_df import serve

VEC = pa.list_(pa.float32(), 3)


def connect(url: str):  # noqa: ANN201 - an ADBC dbapi connection
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the server has no transactions: autocommit only
        return flightsql.connect(url, autocommit=True)


def main(directory: str | None = None) -> int:
    if directory is None:  # a temporary directory, removed afterwards
        with tempfile.TemporaryDirectory(prefix="memwal-serve-") as tmp:
            return main(tmp)
    uri = f"{directory}/docs"
    schema = pa.schema([("id", pa.int64()), ("title", pa.string()), ("vec", VEC)])
    mw.create_table(uri, schema, primary_key="id", region_spec=mw.bucket("id", 4))

    with serve({"docs": uri}) as server:  # loopback, a free port; `memwal serve -t docs=URI` alike
        print("serving on", server.url)
        with connect(server.url) as writer, connect(server.url) as reader:
            with writer.cursor() as cur:
                rows = pa.table(
                    {
                        "id": [1, 2, 3],
                        "title": ["lance tables", "streaming upserts", "flight sql"],
                        "vec": pa.array([[1, 0, 0], [0, 1, 0], [0, 0, 1]], VEC),
                    }
                )
                print("ingested", cur.adbc_ingest("docs", rows, mode="append"), "rows")  # upserts by id
                cur.execute("INSERT INTO docs VALUES (4, 'group commit', [0.5, 0.5, 0.0])")
                cur.execute("DELETE FROM docs WHERE id = 2")
                print("deleted", cur.rowcount, "row")
            with reader.cursor() as cur:  # another connection sees every acknowledged write
                cur.execute("SELECT id, title FROM docs ORDER BY id")
                titles = cur.fetch_arrow_table().to_pylist()
                print(titles)
                cur.execute("SELECT id, _distance FROM vector_search('docs', 'vec', [0.9, 0.1, 0.0], 2)")
                nearest = cur.fetch_arrow_table().column("id").to_pylist()
                print("nearest", nearest)
                cur.execute("SELECT title FROM docs WHERE id = ?", (3,))
                looked_up = cur.fetchall()
                print(looked_up)
    expected = [
        {"id": 1, "title": "lance tables"},
        {"id": 3, "title": "flight sql"},
        {"id": 4, "title": "group commit"},
    ]
    return 0 if titles == expected and nearest == [1, 4] and looked_up == [("flight sql",)] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
