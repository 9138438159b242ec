"""Streaming ingest with concurrent reads: a writer thread appends batches while reader threads
query the table. A reader given the writer (`MemWalTable(uri, writer=w)`) sees every write the
writer acknowledged before the query began; a reader of the durable levels (`MemWalTable(uri)`)
sees the generations flushed so far (regions flush independently). Both are checked on every query:
no acknowledged write missing (writer reader), no row from the future, and counts never going back.

Usage: python examples/streaming_ingest.py [DIRECTORY]   (default: a temporary directory, removed afterwards)
"""

from __future__ import annotations

import sys
import tempfile
import threading

import datafusion
import numpy as np
import pyarrow as pa

import memwal_df as mw

BATCHES, BATCH = 40, 500


def main(directory: str | None = None) -> int:
    if directory is None:  # a temporary directory, removed afterwards
        with tempfile.TemporaryDirectory(prefix="memwal-stream-") as tmp:
            return main(tmp)
    uri = f"{directory}/ticks"
    schema = pa.schema([("id", pa.int64()), ("price", pa.float64())])
    table = mw.create_table(uri, schema, primary_key="id", region_spec=mw.bucket("id", 4))
    acked = 0  # batches the writer has acknowledged (put returned)
    done = threading.Event()
    failures: list[str] = []
    queries = [0, 0]

    def read(ctx: datafusion.SessionContext, fresh: bool) -> None:
        last = 0
        while not done.is_set():
            before = acked
            n = ctx.sql("SELECT count(*) AS n FROM t").to_pylist()[0]["n"]
            after = acked
            queries[fresh] += 1
            # Keys are new in every batch, so the count tells which writes the query saw. A put in
            # flight may be visible in some regions already, hence `after + 1`.
            if n > (after + 1) * BATCH or n < last or (fresh and n < before * BATCH):
                who = "writer" if fresh else "durable"
                failures.append(f"{who} reader saw {n} rows after {last}, {before}..{after} batches acked")
            last = n

    with table.writer(durable=True, max_memtable_rows=2 * BATCH) as w:
        readers = []
        for fresh in (True, False):
            ctx = mw.register(datafusion.SessionContext())
            ctx.register_table("t", mw.MemWalTable(uri, writer=w) if fresh else mw.MemWalTable(uri))
            readers.append(threading.Thread(target=read, args=(ctx, fresh)))
        for r in readers:
            r.start()
        rng = np.random.default_rng(1)
        for i in range(BATCHES):
            w.put(
                pa.table(
                    {
                        "id": pa.array(np.arange(i * BATCH, (i + 1) * BATCH), pa.int64()),
                        "price": rng.random(BATCH),
                    }
                )
            )
            acked += 1
        done.set()
        for r in readers:
            r.join()
    total = mw.MemWalTable(uri).to_table(columns=["id"]).num_rows
    print(
        f"{BATCHES * BATCH:,} rows written; {queries[True]} queries read the writer's MemTables, "
        f"{queries[False]} read the durable levels; {total:,} rows after close()"
    )
    for f in failures:
        print("FAILED:", f)
    return 0 if not failures and total == BATCHES * BATCH and all(queries) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
