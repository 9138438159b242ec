"""Input conforming: column matching (a put needs every column), safe and lossy casts, vector
dimensions, NULL keys, tombstone batches, every accepted input kind, and chunking (RecordBatchReaders
are streamed)."""

from __future__ import annotations

import datetime

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memwal_df.errors import MissingColumnsError, NullPrimaryKeyError, SchemaMismatchError
from memwal_df.format.regions.spec import lance_field_ids
from memwal_df.format.rows import TOMBSTONE, wal_schema
from memwal_df.format.schema import (
    TableSchema,
    check_keys,
    conform,
    delete_batch,
    iter_tables,
    keys_table,
    to_table,
    upsert_chunks,
    upsert_rows,
    with_tombstone,
)

HYP = settings(database=None, deadline=None, max_examples=60)
PK = "lance-schema:unenforced-primary-key"

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False, metadata={PK: "true"}),
        pa.field("name", pa.utf8()),
        pa.field("score", pa.float64()),
        pa.field("cnt", pa.int64()),
        pa.field("label", pa.large_utf8()),
        pa.field("flag", pa.bool_()),
        pa.field("day", pa.date32()),
        pa.field("ts", pa.timestamp("us")),
    ]
)
TS = TableSchema(SCHEMA, ("id",), lance_field_ids(SCHEMA))

# a table with a non-nullable value column (tables opened from Lance may have one)
NN_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("required", pa.int32(), nullable=False),
        pa.field("opt", pa.utf8()),
    ]
)
NN = TableSchema(NN_SCHEMA, ("id",), {"id": 0, "required": 1, "opt": 2})

# a composite key, declared in another order than the columns
COMPOSITE_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int32(), nullable=False),
        pa.field("v", pa.float64()),
        pa.field("tenant", pa.utf8(), nullable=False),
    ]
)
COMPOSITE = TableSchema(COMPOSITE_SCHEMA, ("tenant", "seq"), {"seq": 0, "v": 1, "tenant": 2})

D0 = datetime.date(2024, 3, 1)
T0 = datetime.datetime(2024, 3, 1, 12, 30)


def expected(ids: list[int]) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": [f"n{i}" if i % 2 else None for i in ids],
            "score": [i / 4 if i % 3 else None for i in ids],
            "cnt": [i * 10 if i % 4 else None for i in ids],
            "label": [f"label-{i}" for i in ids],
            "flag": [None if i % 5 == 0 else i % 2 == 0 for i in ids],
            "day": [D0 + datetime.timedelta(days=i) for i in ids],
            "ts": [T0 + datetime.timedelta(seconds=i) for i in ids],
        },
        schema=SCHEMA,
    )


def one_column(src: pa.Array, dst: pa.DataType, nullable: bool = True) -> tuple[pa.Table, pa.Schema]:
    return pa.table({"x": src}), pa.schema([pa.field("x", dst, nullable=nullable)])


def upsert_batch(ts: TableSchema, data: pa.Table) -> pa.RecordBatch:
    """User rows as the WAL-schema batch a region writer appends."""
    return with_tombstone(ts, upsert_rows(ts, data), False)


def with_ids(ids: object) -> pa.Table:
    """Rows of every column of SCHEMA whose `id` column is `ids` (which may hold NULLs)."""
    n = len(ids)  # type: ignore[arg-type]
    return expected(list(range(n))).set_column(0, "id", ids if isinstance(ids, pa.Array) else pa.array(ids))


# ------------------------------------------------------------------ TableSchema


def test_table_schema() -> None:
    assert TS.wal == wal_schema(SCHEMA, TS.field_ids)
    assert TS.wal.names == [*SCHEMA.names, TOMBSTONE]
    assert TS.key_schema.names == ["id"] and not TS.key_schema.field("id").nullable
    assert COMPOSITE.key_schema.names == ["tenant", "seq"]  # primary-key order
    with pytest.raises(SchemaMismatchError):
        TableSchema(SCHEMA, (), TS.field_ids)
    with pytest.raises(SchemaMismatchError):
        TableSchema(SCHEMA, ("nope",), TS.field_ids)


# ------------------------------------------------------------------ conform: columns


@HYP
@given(st.permutations(SCHEMA.names), st.integers(0, 6))
def test_conform_reorders(order: list[str], n: int) -> None:
    full = expected(list(range(n)))
    out = conform(full.select(order), SCHEMA)
    assert out.schema.equals(SCHEMA, check_metadata=True)
    assert out.equals(full)


@HYP
@given(st.sets(st.sampled_from(SCHEMA.names), min_size=1, max_size=len(SCHEMA) - 1), st.integers(0, 6))
def test_input_lacking_columns_is_refused_naming_them(dropped: set[str], n: int) -> None:
    """A put replaces whole rows: input lacking any column, nullable or not, is refused with
    `MissingColumnsError` naming exactly the missing columns, whatever the input kind."""
    given_table = expected(list(range(n))).drop_columns(sorted(dropped))
    want = tuple(c for c in SCHEMA.names if c in dropped)
    reader = pa.RecordBatchReader.from_batches(given_table.schema, given_table.to_batches())
    for data in (given_table, given_table.to_pydict(), given_table.to_pandas(), reader):
        with pytest.raises(MissingColumnsError, match="a put replaces whole rows") as e:
            list(upsert_chunks(TS, data, 2))
        assert e.value.columns == want
        assert all(repr(c) in str(e.value) for c in want)


def test_conform_is_identity_on_conforming_input() -> None:
    t = expected([1, 2, 3])
    assert conform(t, SCHEMA).equals(t)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (pa.table({"id": [1], "extra": [1]}), "extra"),
        (pa.table({"id": [1], "name": ["a"], "Name": ["b"]}), "Name"),  # names are case-sensitive
        (pa.table({"name": ["a"]}), "id"),  # the non-nullable key is missing
        (pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["id", "id"]), "duplicate"),
    ],
)
def test_conform_rejects_bad_columns(data: pa.Table, message: str) -> None:
    with pytest.raises(SchemaMismatchError, match=message):
        conform(data, SCHEMA)


def test_conform_rejects_missing_non_nullable_value_column() -> None:
    with pytest.raises(SchemaMismatchError, match="required"):
        conform(pa.table({"id": [1], "opt": ["a"]}), NN_SCHEMA)
    with pytest.raises(SchemaMismatchError, match="required"):
        upsert_batch(NN, pa.table({"id": [1]}))


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (pa.array(["1"]), pa.int64()),
        (pa.array([1]), pa.utf8()),
        (pa.array([True]), pa.int64()),
        (pa.array([1]), pa.bool_()),
        (pa.array([b"a"]), pa.utf8()),
        (pa.array(["a"]), pa.binary()),
        (pa.array([1.5]), pa.utf8()),
        (pa.array([[1]]), pa.int64()),
        (pa.array([1]), pa.list_(pa.int64())),
        (pa.array([{"a": 1}]), pa.int64()),
        (pa.array([1], pa.timestamp("us")), pa.int64()),
        (pa.array([1]), pa.timestamp("us")),
        (pa.array([D0]), pa.utf8()),
        (pa.array([1]), pa.decimal128(10, 2)),
        (pa.array([["a"]]), pa.list_(pa.int64())),
        (pa.array([["1", "2"]]), pa.list_(pa.float32(), 2)),  # strings that parse are no numbers
    ],
    ids=lambda v: str(v.type) if isinstance(v, pa.Array) else str(v),
)
def test_conform_rejects_incompatible_types(src: pa.Array, dst: pa.DataType) -> None:
    table, target = one_column(src, dst)
    with pytest.raises(SchemaMismatchError, match="'x'"):
        conform(table, target)


# ------------------------------------------------------------------ conform: casts


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (pa.array([1, -(2**31), 2**31 - 1, None], pa.int32()), pa.int64()),
        (pa.array([-128, 127], pa.int8()), pa.int64()),
        (pa.array([0, 2**32 - 1], pa.uint32()), pa.int64()),
        (pa.array([1, -5], pa.int16()), pa.int32()),
        (pa.array([1.5, None, float("inf")], pa.float32()), pa.float64()),
        (pa.array([1, 2**24], pa.int32()), pa.float64()),
        (pa.array(["a", "ü", None, ""], pa.utf8()), pa.large_utf8()),
        (pa.array(["a", None], pa.large_utf8()), pa.utf8()),
        (pa.array(["a"], pa.string_view()), pa.utf8()),
        (pa.array([b"\x00", None], pa.binary()), pa.large_binary()),
        (pa.array([D0, None], pa.date32()), pa.timestamp("us")),
        (pa.array([1, None], pa.timestamp("s")), pa.timestamp("us")),
        (pa.array([[1, None], None, []], pa.list_(pa.int32())), pa.list_(pa.int64())),
        (pa.array([None, None]), pa.int64()),  # an all-NULL column of type null
        (pa.array([None]), pa.list_(pa.utf8())),
        (pa.array([[1.5, -2.0], None, [0.0, 3.0]]), pa.list_(pa.float32(), 2)),  # vectors, one NULL
        (pa.array([None, None]), pa.list_(pa.float32(), 2)),  # no vectors at all (e.g. a dict of Nones)
        (pa.array([[1, 2]], pa.large_list(pa.int32())), pa.list_(pa.float32(), 2)),
    ],
    ids=lambda v: str(v.type) if isinstance(v, pa.Array) else str(v),
)
def test_conform_casts_safe_conversions(src: pa.Array, dst: pa.DataType) -> None:
    table, target = one_column(src, dst)
    out = conform(table, target)
    assert out.schema == target
    assert out.column("x").to_pylist() == src.cast(dst).to_pylist()
    assert out.column("x").null_count == src.null_count


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (pa.array([1, 2**31], pa.int64()), pa.int32()),
        (pa.array([-(2**31) - 1], pa.int64()), pa.int32()),
        (pa.array([300], pa.int64()), pa.int8()),
        (pa.array([2**63], pa.uint64()), pa.int64()),
        (pa.array([-1], pa.int64()), pa.uint64()),
        (pa.array([1.0, 1.5]), pa.int64()),
        (pa.array([float("nan")]), pa.int64()),
        (pa.array([float("inf")]), pa.int32()),
        (pa.array([1e20]), pa.int64()),
        (pa.array([2**53 + 1], pa.int64()), pa.float64()),
        (pa.array([2**24 + 1], pa.int64()), pa.float32()),
        (pa.array([1], pa.timestamp("ns")), pa.timestamp("us")),
        (pa.array([86_400_000 + 1], pa.date64()), pa.date32()),
        (pa.array([[1, 2]], pa.list_(pa.int64())), pa.list_(pa.int64(), 3)),
        (pa.array([[2**40]], pa.list_(pa.int64())), pa.list_(pa.int32())),
    ],
    ids=lambda v: str(v.type) if isinstance(v, pa.Array) else str(v),
)
def test_conform_rejects_lossy_conversions(src: pa.Array, dst: pa.DataType) -> None:
    table, target = one_column(src, dst)
    with pytest.raises(SchemaMismatchError, match="'x'"):
        conform(table, target)


def test_conform_rejects_timestamp_to_date_losing_the_time_of_day() -> None:
    table, target = one_column(pa.array([T0], pa.timestamp("us")), pa.date32())
    with pytest.raises(SchemaMismatchError, match="'x'"):
        conform(table, target)


def test_failed_conversion_names_the_column_in_a_wide_table() -> None:
    t = expected([1]).set_column(3, "cnt", pa.array([1.5]))
    with pytest.raises(SchemaMismatchError, match="'cnt'"):
        conform(t, SCHEMA)


# ------------------------------------------------------------------ NULLs


@pytest.mark.parametrize("ids", [[1, None], [None], pa.nulls(2)])
def test_null_keys_rejected(ids: object) -> None:
    data = with_ids(ids)
    with pytest.raises(NullPrimaryKeyError):
        upsert_batch(TS, data)
    with pytest.raises(NullPrimaryKeyError):
        delete_batch(TS, pa.table({"id": ids}))
    with pytest.raises(NullPrimaryKeyError):
        check_keys(conform(data, SCHEMA), ("id",))


def test_null_in_one_part_of_a_composite_key_rejected() -> None:
    data = pa.table({"tenant": ["a", None], "seq": pa.array([1, 2], pa.int32()), "v": [1.0, 2.0]})
    with pytest.raises(NullPrimaryKeyError, match="tenant"):
        upsert_batch(COMPOSITE, data)
    with pytest.raises(NullPrimaryKeyError, match="tenant"):
        delete_batch(COMPOSITE, data.drop_columns(["v"]))
    data = pa.table({"tenant": ["a", "b"], "seq": pa.array([1, None], pa.int32()), "v": [1.0, 2.0]})
    with pytest.raises(NullPrimaryKeyError, match="seq"):
        upsert_batch(COMPOSITE, data)


def test_nulls_in_non_nullable_value_column_rejected() -> None:
    with pytest.raises(SchemaMismatchError, match="required"):
        upsert_batch(
            NN, pa.table({"id": [1, 2], "required": pa.array([5, None], pa.int32()), "opt": ["a", "b"]})
        )


# ------------------------------------------------------------------ upsert and delete batches


def test_upsert_batch() -> None:
    data = pa.concat_tables([expected([1, 2]), expected([3])])  # two chunks
    shuffled = data.select(list(reversed(SCHEMA.names)))
    batch = upsert_batch(TS, shuffled)
    assert isinstance(batch, pa.RecordBatch)
    assert batch.schema.equals(TS.wal, check_metadata=True)  # with the lance:field_id metadata
    assert batch.column(TOMBSTONE).to_pylist() == [False] * 3
    assert pa.Table.from_batches([batch]).drop_columns([TOMBSTONE]).equals(data.cast(SCHEMA))
    empty = upsert_batch(TS, SCHEMA.empty_table())
    assert empty.num_rows == 0 and empty.schema == TS.wal


@pytest.mark.parametrize(
    "keys",
    [
        pa.array([3, 1], pa.int32()),
        pa.chunked_array([[3], [1]], pa.int64()),
        [3, 1],
        {"id": [3, 1]},
        [{"id": 3}, {"id": 1}],
        pa.table({"id": pa.array([3, 1], pa.int16())}),
        pa.record_batch({"id": pa.array([3, 1], pa.uint8())}),
        pd.DataFrame({"id": [3, 1]}),
    ],
    ids=["array_int32", "chunked", "list", "dict", "rows", "table_int16", "batch_uint8", "pandas"],
)
def test_delete_batch_builds_tombstones(keys: object) -> None:
    batch = delete_batch(TS, keys_table(TS, keys))
    assert batch.schema.equals(TS.wal, check_metadata=True)
    assert batch.column("id").type == pa.int64() and batch.column("id").to_pylist() == [3, 1]
    assert batch.column(TOMBSTONE).to_pylist() == [True, True]
    for f in SCHEMA:
        if f.name != "id":
            assert batch.column(f.name).null_count == 2 and batch.column(f.name).type == f.type


def test_delete_batch_composite_key() -> None:
    keys = pa.table({"seq": [7, 8], "tenant": ["a", "b"]})  # any column order
    batch = delete_batch(COMPOSITE, keys_table(COMPOSITE, keys))
    assert batch.schema.equals(COMPOSITE.wal, check_metadata=True)
    assert batch.to_pylist() == [
        {"seq": 7, "v": None, "tenant": "a", TOMBSTONE: True},
        {"seq": 8, "v": None, "tenant": "b", TOMBSTONE: True},
    ]
    with pytest.raises(SchemaMismatchError):
        keys_table(COMPOSITE, ["a", "b"])  # a bare list cannot name two columns
    with pytest.raises(SchemaMismatchError):
        keys_table(COMPOSITE, pa.array(["a"]))
    with pytest.raises(SchemaMismatchError, match="seq"):
        delete_batch(COMPOSITE, pa.table({"tenant": ["a"]}))  # a key part is missing


def test_delete_batch_errors() -> None:
    with pytest.raises(SchemaMismatchError, match="required"):
        delete_batch(NN, pa.table({"id": [1]}))  # a tombstone needs NULLs in every non-key column
    with pytest.raises(SchemaMismatchError, match="name"):
        delete_batch(TS, pa.table({"id": [1], "name": ["x"]}))  # only key columns
    with pytest.raises(SchemaMismatchError):
        delete_batch(TS, pa.table({"id": ["x"]}))


# ------------------------------------------------------------------ input kinds

IDS = [1, 2, 3, 4, 5]


def _pandas() -> pd.DataFrame:
    t = expected(IDS)
    df = pd.DataFrame(
        {
            "ts": [T0 + datetime.timedelta(seconds=i) for i in IDS],
            "id": IDS,
            "name": t.column("name").to_pylist(),
            "score": [np.nan if v is None else v for v in t.column("score").to_pylist()],
            "cnt": pd.array(t.column("cnt").to_pylist(), dtype="Int64"),
            "label": t.column("label").to_pylist(),
            "flag": t.column("flag").to_pylist(),
            "day": t.column("day").to_pylist(),
        },
        index=[10, 20, 30, 40, 50],  # a non-default index is not written as a column
    )
    return df


INPUTS = {
    "table": lambda: expected(IDS),
    "chunked_table": lambda: pa.concat_tables([expected(IDS[:2]), expected(IDS[2:])]),
    "record_batch": lambda: expected(IDS).to_batches()[0],
    "reader": lambda: pa.RecordBatchReader.from_batches(
        SCHEMA, [*expected(IDS[:2]).to_batches(), *expected(IDS[2:]).to_batches()]
    ),
    "pandas": _pandas,
    "dict": lambda: expected(IDS).to_pydict(),
    "rows": lambda: expected(IDS).to_pylist(),
}


@pytest.mark.parametrize("kind", list(INPUTS))
def test_every_input_kind(kind: str) -> None:
    want = expected(IDS)
    batch = upsert_batch(TS, to_table(INPUTS[kind]()))
    got = pa.Table.from_batches([batch]).drop_columns([TOMBSTONE])
    assert got.to_pylist() == want.to_pylist(), kind
    chunks = list(iter_tables(INPUTS[kind](), 2))
    assert all(c.num_rows <= 2 for c in chunks) and sum(c.num_rows for c in chunks) == len(IDS)
    again = pa.Table.from_batches([upsert_batch(TS, c) for c in chunks]).drop_columns([TOMBSTONE])
    assert again.to_pylist() == want.to_pylist(), kind


def test_rows_with_different_keys_are_refused() -> None:
    """A list of row dicts in which a row leaves out a key (Arrow would make it NULL in that row, or
    drop it when the first row leaves it out) is refused naming the row and the key."""
    rows = expected(IDS).to_pylist()
    del rows[3]["score"]
    with pytest.raises(MissingColumnsError, match=r"row 3 lacks the columns \['score'\]") as e:
        to_table(rows)
    assert e.value.columns == ("score",)
    rows = expected(IDS).to_pylist()
    del rows[0]["flag"]
    with pytest.raises(SchemaMismatchError, match=r"row 1 has the columns \['flag'\] that row 0 lacks"):
        to_table(rows)


@pytest.mark.parametrize("data", ["abc", 42, None, b"bytes", 1.5])
def test_unknown_input_kinds(data: object) -> None:
    with pytest.raises(SchemaMismatchError):
        to_table(data)


@pytest.mark.parametrize("data", [[1, 2, 3], {"id": [1, 2], "name": ["a"]}], ids=["scalars", "ragged_dict"])
def test_malformed_inputs_raise_schema_mismatch(data: object) -> None:
    with pytest.raises(SchemaMismatchError):
        upsert_batch(TS, to_table(data))


def test_empty_lists_are_empty_batches() -> None:
    assert upsert_batch(TS, to_table([])).num_rows == 0
    assert delete_batch(TS, keys_table(TS, [])).num_rows == 0


# ------------------------------------------------------------------ chunking


@pytest.mark.parametrize(
    ("n", "max_rows", "sizes"),
    [(10, 3, [3, 3, 3, 1]), (10, 10, [10]), (10, 100, [10]), (1, 1, [1]), (7, 1, [1] * 7)],
)
def test_iter_tables_chunks_a_table(n: int, max_rows: int, sizes: list[int]) -> None:
    t = expected(list(range(n)))
    chunks = list(iter_tables(t, max_rows))
    assert [c.num_rows for c in chunks] == sizes
    assert pa.concat_tables(chunks).equals(t)


def test_iter_tables_of_an_empty_table_yields_one_empty_chunk() -> None:
    # so that the input is still validated (conform) when it has no rows
    chunks = list(iter_tables(SCHEMA.empty_table(), 5))
    assert len(chunks) == 1 and chunks[0].num_rows == 0 and chunks[0].schema == SCHEMA


class CountingSource:
    """Batches produced lazily, counting how many were pulled."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.pulled = 0

    def reader(self) -> pa.RecordBatchReader:
        def gen():
            start = 0
            for size in self.sizes:
                self.pulled += 1
                rows = expected(list(range(start, start + size)))
                yield pa.RecordBatch.from_pylist(rows.to_pylist(), schema=SCHEMA)
                start += size

        return pa.RecordBatchReader.from_batches(SCHEMA, gen())


def test_reader_is_streamed() -> None:
    src = CountingSource([5, 4, 6])
    it = iter_tables(src.reader(), 3)
    first = next(it)
    assert first.num_rows == 3 and src.pulled == 1  # not read whole
    rest = list(it)
    assert src.pulled == 3
    assert [c.num_rows for c in [first, *rest]] == [3, 2, 3, 1, 3, 3]  # chunks never span batches
    assert pa.concat_tables([first, *rest]).equals(expected(list(range(15))))


@HYP
@given(st.lists(st.integers(1, 9), max_size=6), st.integers(1, 7))
def test_reader_chunking_property(sizes: list[int], max_rows: int) -> None:
    src = CountingSource(sizes)
    chunks = list(iter_tables(src.reader(), max_rows))
    assert all(0 < c.num_rows <= max_rows for c in chunks)
    assert sum(c.num_rows for c in chunks) == sum(sizes)
    assert [r["id"] for c in chunks for r in c.to_pylist()] == list(range(sum(sizes)))
    expected_count = sum(-(-s // max_rows) for s in sizes)
    assert len(chunks) == expected_count


def test_reader_empty_batches_yield_no_chunk() -> None:
    chunks = list(iter_tables(CountingSource([2, 0, 3]).reader(), 10))
    assert [c.num_rows for c in chunks] == [2, 3]
