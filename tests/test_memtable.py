"""MemTable: newest row per key in forward order (against a dict model, with tombstones and composite
keys), lookup agreeing with newest(), the bloom filter holding every key; flushing it as a generation."""

from __future__ import annotations

import uuid
from typing import Any

import lance
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memwal_df.errors import MissingGenerationError
from memwal_df.format import layout
from memwal_df.format.bloom import BloomFilter
from memwal_df.format.open_storage import open_storage
from memwal_df.format.pk_index import pk_index_key
from memwal_df.format.rows import TOMBSTONE, wal_schema
from memwal_df.write.generation import open_generation, primary_key_bytes, write_generation
from memwal_df.write.memtable import MemTable
from memwal_df.write.newest_rows import newest_rows

HYP = settings(database=None, deadline=None, max_examples=150)


class Kind:
    """A table shape: its columns, primary key and a small key domain (so keys repeat)."""

    def __init__(
        self, name: str, fields: list[pa.Field], pk: tuple[str, ...], keys: st.SearchStrategy
    ) -> None:
        self.name = name
        self.schema = pa.schema(fields)
        self.pk = pk
        self.keys = keys
        self.wal = wal_schema(self.schema, {f.name: i for i, f in enumerate(fields)})

    def key_of(self, row: dict[str, Any]) -> Any:
        return row[self.pk[0]] if len(self.pk) == 1 else tuple(row[c] for c in self.pk)

    def row(self, key: Any, value: int | None, tombstone: bool) -> dict[str, Any]:
        parts = (key,) if len(self.pk) == 1 else key
        r: dict[str, Any] = dict(zip(self.pk, parts, strict=True))
        r["v"] = None if tombstone else value
        r[TOMBSTONE] = tombstone
        return {f.name: r[f.name] for f in self.wal}

    def batch(self, rows: list[dict[str, Any]]) -> pa.RecordBatch:
        return pa.RecordBatch.from_pylist(rows, schema=self.wal)

    def key_columns(self, keys: list[Any]) -> list[pa.Array]:
        if len(self.pk) == 1:
            return [pa.array(keys, self.schema.field(self.pk[0]).type)]
        return [pa.array([k[i] for k in keys], self.schema.field(c).type) for i, c in enumerate(self.pk)]


INT = Kind(
    "int64",
    [pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.int64())],
    ("id",),
    st.integers(-3, 6),
)
STR = Kind(
    "utf8",
    [pa.field("v", pa.int64()), pa.field("id", pa.utf8(), nullable=False)],
    ("id",),
    st.sampled_from(["", "a", "b", "ü", "a\x00", "aa", "long key " * 3]),
)
BIN = Kind(
    "binary",
    [pa.field("id", pa.binary(), nullable=False), pa.field("v", pa.int64())],
    ("id",),
    st.binary(max_size=2),
)
# key declared as (tenant, seq), columns in another order
COMPOSITE = Kind(
    "composite",
    [
        pa.field("seq", pa.int32(), nullable=False),
        pa.field("v", pa.int64()),
        pa.field("tenant", pa.utf8(), nullable=False),
    ],
    ("tenant", "seq"),
    st.tuples(st.sampled_from(["a", "b", ""]), st.integers(0, 3)),
)
KINDS = {k.name: k for k in (INT, STR, BIN, COMPOSITE)}


def ops_strategy(kind: Kind) -> st.SearchStrategy:
    op = st.tuples(kind.keys, st.integers(-(2**40), 2**40) | st.none(), st.booleans())
    return st.lists(st.lists(op, max_size=8), max_size=6)  # batches of (key, value, tombstone)


def check_against_model(
    kind: Kind, batches_ops: list[list[tuple[Any, int | None, bool]]], queries: list[Any]
) -> None:
    mt = MemTable(4, kind.wal, kind.pk)
    all_rows: list[dict[str, Any]] = []
    newest: dict[Any, int] = {}  # key -> position of its newest row
    for ops in batches_ops:
        rows = [kind.row(k, v, t) for k, v, t in ops]
        mt.append(kind.batch(rows))
        for r in rows:
            newest[kind.key_of(r)] = len(all_rows)
            all_rows.append(r)
        # asked between writes too: the kept answer is patched by the rows written since
        assert mt.newest_positions().tolist() == sorted(newest.values())

    assert len(mt) == mt.num_rows == len(all_rows)
    assert mt.num_keys == len(newest)
    assert mt.batches == [b for b in mt.batches if b.num_rows]  # empty writes are not kept
    assert mt.to_table().to_pylist() == all_rows  # every row, in write order
    positions = sorted(newest.values())
    assert mt.newest_positions().tolist() == positions
    got = mt.newest()
    assert got.schema == kind.wal
    assert got.to_pylist() == [all_rows[p] for p in positions]  # one row per key, forward order
    assert len({kind.key_of(r) for r in got.to_pylist()}) == got.num_rows

    # find returns what newest() holds for the asked keys (repeats and unknown keys allowed)
    looked, hit = mt.find(None, pk_index_key(kind.key_columns(queries)))
    asked = set(queries)
    assert looked.to_pylist() == [r for r in got.to_pylist() if kind.key_of(r) in asked]
    held = {kind.key_of(r) for r in got.to_pylist()}
    assert hit.tolist() == [q in held for q in queries]
    # sealed, it answers the same from one contiguous copy of its newest rows
    before = mt.held_bytes
    mt.seal()
    for _ in range(2):
        sealed, sealed_hit = mt.find(None, pk_index_key(kind.key_columns(queries)))
        assert sealed.to_pylist() == looked.to_pylist() and sealed_hit.tolist() == hit.tolist()
    assert mt.newest().to_pylist() == got.to_pylist()
    assert mt.held_bytes >= before

    # the bloom filter holds every key written (tombstones included) and nothing else
    if all_rows:
        written = [kind.key_of(r) for r in all_rows]
        assert mt.bloom.might_contain(kind.key_columns(written)).all()
        fresh = BloomFilter.empty()
        fresh.insert_keys(kind.key_columns(written))
        assert mt.bloom == fresh
    else:
        assert mt.bloom == BloomFilter.empty()


@pytest.mark.parametrize("kind_name", list(KINDS))
def test_newest_lookup_bloom_against_model(kind_name: str) -> None:
    kind = KINDS[kind_name]

    @HYP
    @given(ops_strategy(kind), st.lists(kind.keys, max_size=10))
    def run(batches_ops: list, queries: list) -> None:
        check_against_model(kind, batches_ops, queries)

    run()


def test_tombstone_is_the_newest_row() -> None:
    k = INT
    mt = MemTable(1, k.wal, k.pk)
    mt.append(k.batch([k.row(1, 10, False), k.row(2, 20, False), k.row(1, 11, False)]))
    mt.append(k.batch([k.row(1, None, True), k.row(3, 30, False)]))
    mt.append(k.batch([k.row(3, 31, False), k.row(2, None, True), k.row(2, 22, False)]))
    assert mt.newest().to_pylist() == [
        k.row(1, None, True),  # deleted: the tombstone is kept (it hides older generations)
        k.row(3, 31, False),
        k.row(2, 22, False),  # re-inserted after its delete
    ]
    looked, hit = mt.find(None, pk_index_key([pa.array([2, 1, 99, 2])]))
    assert looked.to_pylist() == [k.row(1, None, True), k.row(2, 22, False)]
    assert hit.tolist() == [True, True, False, True]
    assert mt.num_keys == 3 and mt.num_rows == 8


def test_empty_memtable() -> None:
    mt = MemTable(7, INT.wal, INT.pk)
    assert mt.generation == 7 and mt.last_wal_position == 0 and mt.nbytes == 0
    assert len(mt) == 0 and mt.num_keys == 0
    assert mt.newest().num_rows == 0 and mt.newest().schema == INT.wal
    assert mt.to_table().num_rows == 0
    for asked in ([1], []):
        looked, hit = mt.find(None, pk_index_key([pa.array(asked, pa.int64())]))
        assert looked.num_rows == 0 and hit.tolist() == [False] * len(asked)
    mt.append(INT.batch([]))
    assert mt.batches == [] and mt.bloom == BloomFilter.empty()


def test_no_duplicates_keeps_every_row_in_order() -> None:
    mt = MemTable(1, INT.wal, INT.pk)
    b1 = INT.batch([INT.row(i, i, False) for i in (5, 1, 3)])
    b2 = INT.batch([INT.row(i, i, False) for i in (2, 4)])
    mt.append(b1)
    mt.append(b2)
    assert mt.newest().equals(pa.Table.from_batches([b1, b2]))
    assert mt.nbytes == b1.nbytes + b2.nbytes


# ------------------------------------------------------------------ flushing a MemTable


@pytest.mark.parametrize(
    ("columns", "pk", "want"),
    [
        ({"k": pa.array(["a", "bb", "", "hello"])}, ("k",), 24),  # Lance 14's own example
        ({"k": pa.array([b"a", b"bb", b"", b"hello"], pa.binary())}, ("k",), 24),
        ({"k": pa.array([1, 2, 3, 4], pa.int64())}, ("k",), 32),
        ({"k": pa.array([1, 2, 3], pa.int32())}, ("k",), 12),
        ({"k": pa.array(["xy", "z"], pa.large_utf8())}, ("k",), 3 + 8),
        (
            {"i": pa.array([1, 2, 3, 4], pa.int64()), "s": pa.array(["a", "b", "c", ""])},
            ("i", "s"),
            32 + 3 + 16,
        ),
    ],
)
def test_primary_key_bytes(columns: dict[str, pa.Array], pk: tuple[str, ...], want: int) -> None:
    assert primary_key_bytes(pa.table(columns), pk) == want


def test_flush_writes_newest_rows(table_uri: str, table_storage_options: dict[str, str] | None) -> None:
    storage = open_storage(table_uri, table_storage_options)
    region = uuid.uuid4()
    k = COMPOSITE
    mt = MemTable(3, k.wal, k.pk)
    mt.append(k.batch([k.row(("a", 1), 1, False), k.row(("b", 1), 2, False), k.row(("a", 2), 3, False)]))
    mt.append(k.batch([k.row(("a", 1), None, True), k.row(("b", 1), 4, False)]))
    sst = write_generation(storage, region, mt, "2.0")
    prefix, gen = layout.parse_generation_dir_name(sst.path)
    assert gen == 3 and sst.generation == 3 and len(prefix) == 8
    assert sst.physical_rows == 3 and sst.in_memory_bytes == mt.nbytes
    assert sst.primary_key_bytes == primary_key_bytes(mt.newest(), k.pk)
    ds = open_generation(storage, region, sst)
    assert ds.to_table().to_pylist() == mt.newest().to_pylist()  # newest per key, forward order
    assert len(ds.get_fragments()) == 1
    rel = layout.generation_path(region, sst.path)
    assert storage.get(f"{rel}/{layout.BLOOM_FILTER_FILE}") == mt.bloom.to_bytes()
    assert storage.list(f"{rel}/{layout.PK_INDEX_DIR}")
    # a second flush of the same generation goes to a new directory
    again = write_generation(storage, region, mt, "2.0")
    assert again.path != sst.path and again.generation == 3
    lance_uri = storage.child_uri(rel)
    assert lance.dataset(lance_uri, storage_options=table_storage_options).count_rows() == 3

    missing = type(sst)()
    missing.CopyFrom(sst)
    missing.path = "00000000_gen_3"
    with pytest.raises(MissingGenerationError):
        open_generation(storage, region, missing)


@pytest.mark.parametrize("kind_name", ["int64", "composite"])
def test_newest_rows_over_a_stack_of_memtables_against_model(kind_name: str) -> None:
    """Keys resolved newest level first: the newest MemTable holding a key answers (a tombstone there
    means no row, older levels not consulted), whatever the older levels hold."""
    kind = KINDS[kind_name]

    @HYP
    @given(st.lists(ops_strategy(kind), min_size=1, max_size=4), st.lists(kind.keys, max_size=12))
    def run(levels_ops: list, queries: list) -> None:
        levels = []
        for g, batches_ops in enumerate(levels_ops):  # oldest first
            mt = MemTable(g, kind.wal, kind.pk)
            for ops in batches_ops:
                mt.append(kind.batch([kind.row(k, v, t) for k, v, t in ops]))
            if g % 2 == 0:
                mt.seal()
            levels.append(mt)
        model: dict[Any, dict[str, Any]] = {}  # key -> newest row over all levels
        for mt in levels:
            for r in mt.newest().to_pylist():
                model[kind.key_of(r)] = r
        schema = pa.schema([kind.schema.field(c) for c in kind.schema.names])
        asked = pk_index_key(kind.key_columns(queries))
        rows, resolved = newest_rows(list(reversed(levels)), asked, schema)
        assert resolved.tolist() == [q in model for q in queries]
        live = {q for q in queries if q in model and not model[q][TOMBSTONE]}
        got = rows.to_pylist()
        assert sorted(map(kind.key_of, got), key=repr) == sorted(live, key=repr)
        for r in got:
            assert r == {c: model[kind.key_of(r)][c] for c in kind.schema.names}

    run()
