"""Test support for base compaction and index upkeep: a table with text and small vectors, a BTREE
on the key, an INVERTED index on the text and an IVF_PQ index on the vectors, written through a
real writer and mirrored in a dict model (key -> row).

Every value is exact in float32, so rows read back through Lance or DataFusion compare equal to the
model. `sql_rows` reads through one DataFusion context (`memwal_df.MemWalTable`), `lance_rows`
through Lance alone (the base only); `fragments`, `segments` and `coverage` describe the base.
"""

from __future__ import annotations

import random
from typing import Any

import datafusion
import lance
import pyarrow as pa

import memwal_df as mw
from memwal_df.format import memwal_index

DIM = 4
WORDS = ["apple", "fig", "kiwi", "pear", "plum", "lime"]
SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("text", pa.string()),
        pa.field("vec", pa.list_(pa.float32(), DIM)),
    ]
)
INDEXES = ("id_idx", "text_idx", "vec_idx")

Row = dict[str, Any]


def make_row(key: int, seed: int) -> Row:
    """A row whose text and vector depend on (key, seed); vector entries are multiples of 1/8."""
    rng = random.Random(seed * 1_000_003 + key)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
    return {"id": key, "text": text, "vec": [rng.randint(-32, 32) / 8 for _ in range(DIM)]}


def to_table(rows: list[Row]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=SCHEMA)


class Lsm:
    """A MemWAL table of `base` rows (keys 0..base-1) in `regions` bucket regions, with the three
    indexes when `indexes`; `model` is what every read must return."""

    def __init__(
        self,
        uri: str,
        options: dict[str, str] | None = None,
        base: int = 600,
        regions: int = 2,
        indexes: bool = True,
        partitions: int = 2,
    ) -> None:
        rows = [make_row(k, 0) for k in range(base)]
        self.table = mw.create_table(
            uri, to_table(rows), "id", region_spec=mw.bucket("id", regions), storage_options=options
        )
        self.uri, self.options = uri, options
        self.model: dict[int, Row] = {r["id"]: r for r in rows}
        self.next_key = base
        self.seed = 0
        if indexes:
            lance.dataset(uri, storage_options=options).create_scalar_index("id", "BTREE")
            lance.dataset(uri, storage_options=options).create_scalar_index(
                "text", "INVERTED", stem=False, remove_stop_words=False
            )
            lance.dataset(uri, storage_options=options).create_index(
                "vec", "IVF_PQ", num_partitions=partitions, num_sub_vectors=2
            )
        self.table.refresh()

    def generation(
        self, new: int = 0, update: list[int] | None = None, delete: list[int] | None = None
    ) -> None:
        """One flushed write (a generation in each region it touches): `new` rows with fresh keys,
        new values for the keys `update`, then tombstones for `delete`."""
        self.seed += 1
        keys = list(range(self.next_key, self.next_key + new)) + sorted(set(update or ()))
        self.next_key += new
        rows = [make_row(k, self.seed) for k in keys]
        with self.table.writer() as w:
            if rows:
                w.put(to_table(rows))
            if delete:
                w.delete(pa.table({"id": pa.array(sorted(set(delete)), pa.int64())}))
            w.flush()
        self.model.update({r["id"]: r for r in rows})
        for k in delete or ():
            self.model.pop(k, None)

    def dataset(self, version: int | None = None) -> lance.LanceDataset:
        return lance.dataset(self.uri, version=version, storage_options=self.options)

    def context(self) -> datafusion.SessionContext:
        """A DataFusion context with this table registered once as `t`."""
        ctx = mw.register(datafusion.SessionContext())
        ctx.register_table("t", mw.MemWalTable(self.uri, storage_options=self.options))
        return ctx


def sql_rows(ctx: datafusion.SessionContext, query: str = "SELECT * FROM t") -> dict[int, Row]:
    rows = ctx.sql(query).to_arrow_table().to_pylist()
    out = {r["id"]: {k: r[k] for k in ("id", "text", "vec")} for r in rows}
    assert len(out) == len(rows), "a key read twice"
    return out


def lance_rows(ds: lance.LanceDataset) -> dict[int, Row]:
    rows = ds.to_table().to_pylist()
    out = {r["id"]: r for r in rows}
    assert len(out) == len(rows), "a key stored twice in the base"
    return out


def fragments(ds: lance.LanceDataset) -> dict[int, tuple[int, int]]:
    """Fragment id -> (physical rows, deleted rows)."""
    out = {}
    for f in ds.get_fragments():
        m = f.metadata
        out[m.id] = (m.physical_rows, m.deletion_file.num_deleted_rows if m.deletion_file else 0)
    return out


def segments(ds: lance.LanceDataset, name: str) -> list[set[int]]:
    """Fragment ids of each segment of index `name`."""
    (d,) = [d for d in ds.describe_indices() if d.name == name]
    return [set(s.fragment_ids or ()) for s in d.segments]


def coverage(ds: lance.LanceDataset) -> dict[str, set[int]]:
    return {name: set().union(*segments(ds, name)) for name in INDEXES}


def progress(lsm: Lsm, version: int | None = None) -> tuple[dict, dict]:
    """(merged generations, index catch-up) recorded at `version` (None: latest)."""
    ds = lsm.dataset(version)
    found = memwal_index.read_details(lsm.uri, lsm.options, ds.version)
    assert found is not None
    return memwal_index.merged_generations(found[0]), memwal_index.index_catchup(found[0])
