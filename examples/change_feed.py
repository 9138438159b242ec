"""Change data capture with the change feed: keep a copy of a table in another system (here a dict,
standing in for a key-value store or a search index) while the table is written, merged and
garbage-collected.

The copy starts from the table's rows: the feed's latest offsets are taken first, then the rows are
read (changes flushed in between are applied again later, which leaves them as they are). A
registered consumer then reads `table.changes(consumer=...)` after each round of writes and
background jobs, applies the net changes (`net_changes`: per key the last upsert or delete) and
commits its offsets; GC, which ran before it read, kept every generation it had not read. At the end
the copy must equal the table.

Usage: python examples/change_feed.py [DIRECTORY]   (default: a temporary directory, removed afterwards)
"""

from __future__ import annotations

import sys
import tempfile
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa

import memwal_df as mw

ROUNDS, BATCHES, BATCH, KEYS = 3, 10, 200, 2_000


def main(directory: str | None = None) -> int:
    if directory is None:  # a temporary directory, removed afterwards
        with tempfile.TemporaryDirectory(prefix="memwal-cdc-") as tmp:
            return main(tmp)
    uri = f"{directory}/orders"
    initial = pa.table({"id": pa.array(np.arange(500), pa.int64()), "qty": pa.array(np.zeros(500))})
    table = mw.create_table(uri, initial, primary_key="id", region_spec=mw.bucket("id", 4))

    start = table.changes("latest").start  # offsets first, then the rows they start after
    copy: dict[Any, dict[str, Any]] = {r["id"]: r for r in mw.MemWalTable(uri).to_table().to_pylist()}
    table.register_consumer("orders-mirror", since=start)
    source = mw.open_table(uri)  # the consumer's own handle (usually another process)

    def sync() -> int:
        """Apply every change since the consumer's committed offsets; commit the new ones."""
        feed = source.changes(consumer="orders-mirror")
        changes = feed.read_all()
        upserts, deletes = mw.net_changes(changes, ["id"])
        for key in deletes.column("id").to_pylist():
            copy.pop(key, None)
        copy.update((r["id"], r) for r in upserts.to_pylist())
        feed.commit()
        return changes.num_rows

    rng = np.random.default_rng(7)
    applied = 0
    for _ in range(ROUNDS):
        with table.writer(max_memtable_rows=3 * BATCH) as w:  # a flush every few batches
            for _ in range(BATCHES):
                ids = rng.choice(KEYS, BATCH, replace=False)
                w.put(pa.table({"id": pa.array(ids, pa.int64()), "qty": rng.random(BATCH)}))
                dead = rng.choice(KEYS, BATCH // 10, replace=False)
                w.delete(pa.table({"id": pa.array(dead, pa.int64())}))
        # merge, drop old base versions, GC: the generations the consumer has not read stay
        table.maintain(interval=0, max_rounds=1, grace=timedelta(0), version_retention=timedelta(0))
        applied += sync()

    rows = {r["id"]: r for r in mw.MemWalTable(uri).to_table().to_pylist()}
    print(f"{len(rows):,} rows in the table, {len(copy):,} in the copy kept by {applied:,} changes")
    if copy != rows:
        print("FAILED: the copy differs from the table")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
