"""Change data capture with the change feed: keep a copy of a table in another system (here a dict,
standing in for a key-value store or a search index) while the table is written, merged and
garbage-collected.

The copy starts from the table's rows: the feed's latest offsets are taken first, then the rows are
read (changes flushed in between are applied again later, which leaves them as they are). A
registered consumer then polls `table.changes(consumer=...)`, applies each read's net changes
(`net_changes`: per key the last upsert or delete) and commits its offsets; GC keeps every
generation it has not read. At the end the copy must equal the table.

Usage: python examples/change_feed.py [DIRECTORY]   (default: a temporary directory)
"""

from __future__ import annotations

import sys
import tempfile
import threading
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa

import memwal_df as mw
from memwal_df.read.changes import net_changes

BATCHES, BATCH, KEYS = 30, 200, 2_000


def main(directory: str | None = None) -> int:
    uri = f"{directory or tempfile.mkdtemp(prefix='memwal-cdc-')}/orders"
    initial = pa.table({"id": pa.array(np.arange(500), pa.int64()), "qty": pa.array(np.zeros(500))})
    table = mw.create_table(uri, initial, primary_key="id", region_spec=mw.bucket("id", 4))

    start = table.changes("latest").start  # offsets first, then the rows they start after
    copy: dict[Any, dict[str, Any]] = {r["id"]: r for r in mw.MemWalTable(uri).to_table().to_pylist()}
    table.register_consumer("orders-mirror", since=start)
    done = threading.Event()

    def consume() -> None:
        source = mw.open_table(uri)  # the consumer's own handle (usually another process)
        while True:
            finished = done.is_set()  # read once more after the writer finished
            feed = source.changes(consumer="orders-mirror")
            upserts, deletes = net_changes(feed.read_all(), ["id"])
            for key in deletes.column("id").to_pylist():
                copy.pop(key, None)
            copy.update((r["id"], r) for r in upserts.to_pylist())
            feed.commit()
            if finished:
                return
            done.wait(0.02)

    consumer = threading.Thread(target=consume)
    consumer.start()
    rng = np.random.default_rng(7)
    with table.writer(max_memtable_rows=3 * BATCH) as w:  # a flush every few batches
        for i in range(BATCHES):
            ids = rng.choice(KEYS, BATCH, replace=False)
            w.put(pa.table({"id": pa.array(ids, pa.int64()), "qty": rng.random(BATCH)}))
            w.delete(pa.table({"id": pa.array(rng.choice(KEYS, BATCH // 10, replace=False), pa.int64())}))
            if i % 10 == 9:  # merge, clean up base versions, GC: kept what the consumer has not read
                table.maintain(interval=0, max_rounds=1, grace=timedelta(0), version_retention=timedelta(0))
    done.set()
    consumer.join()

    rows = {r["id"]: r for r in mw.MemWalTable(uri).to_table().to_pylist()}
    print(f"{len(rows):,} rows in the table, {len(copy):,} in the copy kept by the change feed")
    if copy != rows:
        print("FAILED: the copy differs from the table")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
