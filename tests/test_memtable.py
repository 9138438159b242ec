"""MemTable: newest row per key in forward order (against a dict model, with tombstones and composite
keys), takes by position, the bloom filter holding every key; the key directory over a changing stack
of MemTables; flushing a MemTable as a generation and reading it back."""

from __future__ import annotations

import uuid
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.optional import not_none

from memwal_df.errors import MissingGenerationError
from memwal_df.format import layout
from memwal_df.format.bloom import BloomFilter
from memwal_df.format.open_storage import open_storage
from memwal_df.format.pk_index import pk_index_key
from memwal_df.format.rows import TOMBSTONE, wal_schema
from memwal_df.write import memtable as memtable_module
from memwal_df.write.generation import (
    generation_memtable,
    open_generation,
    primary_key_bytes,
    write_generation,
)
from memwal_df.write.key_directory import KeyDirectory
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


def check_against_model(kind: Kind, batches_ops: list[list[tuple[Any, int | None, bool]]]) -> None:
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

    # take_rows returns the rows at the positions asked: open, sealed (from its batches), and sealed
    # once its one-chunk newest() is made (from that)
    names = [f.name for f in kind.schema]
    some = positions[::2]
    want = [{c: all_rows[p][c] for c in [*names, TOMBSTONE]} for p in some]
    assert mt.take_rows(np.array(some, np.int64), names).to_pylist() == want
    before = mt.held_bytes
    mt.seal()
    assert mt.take_rows(np.array(some, np.int64), names).to_pylist() == want
    assert mt.newest().to_pylist() == got.to_pylist()
    for _ in range(2):
        assert mt.take_rows(np.array(some, np.int64), names).to_pylist() == want
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
def test_newest_take_bloom_against_model(kind_name: str) -> None:
    kind = KINDS[kind_name]

    @HYP
    @given(ops_strategy(kind))
    def run(batches_ops: list) -> None:
        check_against_model(kind, batches_ops)

    run()


@pytest.mark.parametrize("one_take_rows", [None, 0], ids=["small-memtable", "take-per-batch"])
def test_take_rows_between_writes_against_model(one_take_rows: int | None) -> None:
    # Takes after any write, from many small batches, then sealed (before its one-chunk newest() is
    # made, and after); with one take over all batches, or one per batch, for many rows.
    @given(
        st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=20), min_size=1, max_size=30),
        st.lists(st.tuples(st.integers(0, 29), st.integers(0, 2**32)), max_size=12),
    )
    @HYP
    def run(batches: list[list[int]], asks: list[tuple[int, int]]) -> None:
        with pytest.MonkeyPatch.context() as mp:
            if one_take_rows is not None:
                mp.setattr(memtable_module, "_CHUNKED_TAKE_ROWS", one_take_rows)
            check_takes(batches, asks)

    run()


def check_takes(batches: list[list[int]], asks: list[tuple[int, int]]) -> None:
    k = INT
    mt = MemTable(1, k.wal, k.pk)
    all_rows: list[dict[str, Any]] = []
    newest: dict[Any, int] = {}
    when = {i: [seed for at, seed in asks if at == i] for i in range(len(batches))}

    def check(seed: int) -> None:
        positions = sorted(newest.values())
        if seed % 4 == 0:  # the last few: cut as slices
            some = positions[-1 - seed % 3 :]
        else:  # about two in three
            some = [p for p in positions if (p * 2654435761 + seed) % 3]
        columns = ["v"] if seed % 2 else ["id", "v"]
        want = [{c: all_rows[p][c] for c in [*columns, TOMBSTONE]} for p in some]
        assert mt.take_rows(np.array(some, np.int64), columns).to_pylist() == want

    for i, keys in enumerate(batches):
        rows = [k.row(key, len(all_rows) + j, False) for j, key in enumerate(keys)]
        mt.append(k.batch(rows))
        for r in rows:
            newest[r["id"]] = len(all_rows)
            all_rows.append(r)
        for seed in when[i]:
            check(seed)
    mt.seal()
    for seed in (0, 1):  # its newest() not made yet
        check(seed)
    assert mt.newest().num_rows == len(newest)
    for seed in (2, 4):
        check(seed)


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
    level = KeyDirectory().level([mt])
    looked, at = level.find(None, pk_index_key([pa.array([2, 1, 99, 2])]), ["id", "v"])
    assert looked.to_pylist() == [k.row(1, None, True), k.row(2, 22, False)]
    assert at.tolist() == [1, 0, -1, 1]
    assert mt.num_keys == 3 and mt.num_rows == 8


def test_empty_memtable() -> None:
    mt = MemTable(7, INT.wal, INT.pk)
    assert mt.generation == 7 and mt.last_wal_position == 0 and mt.nbytes == 0
    assert len(mt) == 0 and mt.num_keys == 0
    assert mt.newest().num_rows == 0 and mt.newest().schema == INT.wal
    assert mt.to_table().num_rows == 0
    for asked in ([1], []):
        looked, at = KeyDirectory().level([mt]).find(None, pk_index_key([pa.array(asked, pa.int64())]), ["v"])
        assert looked.num_rows == 0 and at.tolist() == [-1] * len(asked)
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
    prefix, gen = not_none(layout.parse_generation_dir_name(sst.path))
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
    back = generation_memtable(storage, region, sst, k.wal, k.pk)  # read back: the same newest rows
    assert back.generation == 3 and back.newest().to_pylist() == mt.newest().to_pylist()
    lance_uri = storage.child_uri(rel)
    assert lance.dataset(lance_uri, storage_options=table_storage_options).count_rows() == 3

    missing = type(sst)()
    missing.CopyFrom(sst)
    missing.path = "00000000_gen_3"
    with pytest.raises(MissingGenerationError):
        open_generation(storage, region, missing)
    with pytest.raises(MissingGenerationError):
        generation_memtable(storage, region, missing, k.wal, k.pk)


@pytest.mark.parametrize("kind_name", list(KINDS))
def test_key_directory_over_a_changing_stack_of_memtables_against_model(kind_name: str) -> None:
    """A writer's key directory answers each asked key from the newest MemTable held that holds it (a
    tombstone there means no live row: `newest_rows` returns none, and older MemTables are not
    consulted), while the active MemTable takes writes between lookups, is sealed and replaced, the
    oldest MemTables are dropped and older generations are read back below the held ones."""
    kind = KINDS[kind_name]
    step = st.one_of(
        st.tuples(
            st.just("write"), st.lists(st.tuples(kind.keys, st.integers(0, 99), st.booleans()), max_size=6)
        ),
        st.tuples(st.just("seal"), st.none()),
        st.tuples(st.just("drop"), st.none()),
        st.tuples(
            st.just("load"), st.lists(st.tuples(kind.keys, st.integers(0, 99), st.booleans()), max_size=6)
        ),
        st.tuples(st.just("ask"), st.lists(kind.keys, max_size=10)),
    )

    @HYP
    @given(st.lists(step, max_size=25))
    def run(steps: list) -> None:
        directory = KeyDirectory()
        held = [MemTable(100, kind.wal, kind.pk)]  # oldest first; the last one is active
        names = list(kind.schema.names)
        schema = pa.schema([kind.schema.field(c) for c in names])
        for op, arg in steps:
            if op == "write":
                held[-1].append(kind.batch([kind.row(k, v, t) for k, v, t in arg]))
            elif op == "seal":
                held[-1].seal()
                held.append(MemTable(held[-1].generation + 1, kind.wal, kind.pk))
            elif op == "drop" and len(held) > 1:
                held.pop(0)
            elif op == "load":  # a generation read back from storage, older than every held one
                loaded = MemTable(held[0].generation - 1, kind.wal, kind.pk)
                loaded.append(kind.batch([kind.row(k, v, t) for k, v, t in arg]))
                loaded.seal()
                held.insert(0, loaded)
            elif op == "ask":
                model: dict[Any, dict[str, Any]] = {}
                for mt in held:
                    for r in mt.newest().to_pylist():
                        model[kind.key_of(r)] = r
                asked = pk_index_key(kind.key_columns(arg))
                level = directory.level(list(reversed(held)))
                rows, at = level.find(None, asked, names)
                assert (at >= 0).tolist() == [q in model for q in arg]
                got = {kind.key_of(r): r for r in rows.to_pylist()}
                assert len(got) == rows.num_rows  # one row per key
                assert got == {q: model[q] for q in arg if q in model}
                listed = rows.to_pylist()
                assert [listed[i] for i in at if i >= 0] == [model[q] for q in arg if q in model]
                found = newest_rows([directory.level(list(reversed(held)))], asked, schema)
                assert found.resolved.tolist() == (at >= 0).tolist()
                live = found.rows.to_pylist()
                want = [
                    {c: model[q][c] for c in names} if q in model and not model[q][TOMBSTONE] else None
                    for q in arg
                ]
                assert [live[i] if i >= 0 else None for i in found.at] == want
        directory.level(list(reversed(held)))
        assert len(directory) <= sum(mt.num_keys for mt in held)  # dropped MemTables' keys are forgotten

    run()


def test_key_directory_when_an_older_memtable_takes_a_dropped_ones_generation() -> None:
    """A MemTable read back under the generation of one dropped before, older than the active one:
    the active MemTable's newer row still answers."""
    k = INT
    active = MemTable(100, k.wal, k.pk)
    active.append(k.batch([k.row(0, 0, False)]))
    dropped = MemTable(99, k.wal, k.pk)
    directory = KeyDirectory()
    directory.level([active, dropped])
    again = MemTable(99, k.wal, k.pk)
    again.append(k.batch([k.row(0, 1, False)]))
    again.seal()
    rows, at = directory.level([active, again]).find(None, pk_index_key([pa.array([0])]), ["id", "v"])
    assert at.tolist() == [0] and rows.to_pylist() == [k.row(0, 0, False)]


@pytest.mark.parametrize(
    "key_type", [pa.float64(), pa.float32(), pa.timestamp("us"), pa.date32(), pa.large_string()]
)
def test_key_directory_compares_keys_as_arrow_hashing_does(key_type: pa.DataType) -> None:
    """Keys the directory finds equal are the keys the MemTable's newest rows count as one (Arrow's
    hashing): for floats 0.0 and -0.0 are two keys, as are NaNs of other bits."""
    if pa.types.is_floating(key_type):
        keys: list[Any] = [0.0, -0.0, float("nan"), 1.5, -float("nan"), 0.0, float("nan")]
    elif pa.types.is_large_string(key_type):
        keys = ["a", "", "a\x00", "", "b", "a"]
    else:
        ints = pa.array([1, 2, 3, 2, 4, 1], pa.int32() if key_type.bit_width == 32 else pa.int64())
        keys = ints.view(key_type).to_pylist()
    schema = pa.schema([pa.field("id", key_type, nullable=False), pa.field("v", pa.int64())])
    wal = wal_schema(schema, {"id": 0, "v": 1})
    mt = MemTable(1, wal, ["id"])
    for i, k in enumerate(keys):  # one write per row: the directory covers several batches
        mt.append(pa.RecordBatch.from_pylist([{"id": k, "v": i, TOMBSTONE: False}], schema=wal))
    newest = mt.newest()
    rows, at = KeyDirectory().level([mt]).find(None, newest.column("id").combine_chunks(), ["id", "v"])
    assert (at >= 0).all()
    assert rows.take(pa.array(at)).column("v").to_pylist() == newest.column("v").to_pylist()


@pytest.mark.parametrize("kind_name", list(KINDS))
def test_snapshots_answer_as_of_when_they_were_taken_against_model(kind_name: str) -> None:
    """A snapshot taken between writes, read only after later writes (and a seal): its rows (copied
    when first asked for), its keys and its lookups by key are those of the moment it was taken."""
    kind = KINDS[kind_name]

    @HYP
    @given(ops_strategy(kind), st.lists(st.booleans(), min_size=6, max_size=6))
    def run(batches_ops: list, read_now: list[bool]) -> None:
        mt = MemTable(2, kind.wal, kind.pk)
        all_rows: list[dict[str, Any]] = []
        taken = []  # (snapshot, the model's newest rows then)
        for i, ops in enumerate(batches_ops):
            rows = [kind.row(k, v, t) for k, v, t in ops]
            mt.append(kind.batch(rows))
            all_rows += rows
            if not all_rows:
                continue
            newest = {kind.key_of(r): p for p, r in enumerate(all_rows)}
            snapshot = mt.snapshot()
            if read_now[i]:
                snapshot.table  # noqa: B018 - copied now, before the later writes
            else:  # a projection first: copies only that column
                assert snapshot.columns(kind.pk).to_pylist() == [
                    {c: all_rows[p][c] for c in kind.pk} for p in sorted(newest.values())
                ]
            taken.append((snapshot, newest))
        mt.seal()
        names = [f.name for f in kind.schema]
        for snapshot, newest in taken:
            positions = sorted(newest.values())
            assert snapshot.columns([TOMBSTONE]).column(0).to_pylist() == [
                all_rows[p][TOMBSTONE] for p in positions
            ]
            assert snapshot.table.to_pylist() == [all_rows[p] for p in positions]
            assert pk_index_key([snapshot.table.column(c) for c in kind.pk]).equals(snapshot.keys)
            asked = [kind.key_of(all_rows[p]) for p in positions[::2]]
            found = snapshot.positions_of(pk_index_key(kind.key_columns(asked)))
            assert found.tolist() == sorted(newest[k] for k in asked)
            assert snapshot.take(found, names).to_pylist() == [
                {c: all_rows[p][c] for c in [*names, TOMBSTONE]} for p in found.tolist()
            ]

    run()
