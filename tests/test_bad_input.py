"""Bad input never corrupts a table, and what is corrupt is never read (extends `test_writer.py`'s
schema checks and `test_wal.py` / `test_manifest.py`'s decoders):

* null and duplicate keys in one batch, wrong schemas on the routed and the region writer, deletes
  with wrong keys: rejected with typed errors before any region receives a row, or resolved exactly
  (the last row of a key wins, through flush and merge: the base keeps unique keys);
* puts lacking a column (every input kind), vectors of another dimension, lists of strings for
  vectors, malformed region ids: typed errors naming the column or argument, nothing written;
* keys of every Arrow type Lance 14 accepts as a primary key, with their edge values, through put,
  delete, crash + replay, flush, merge and the SQL reader;
* corrupt or truncated WAL entries and manifests: every entry point (claim, recover, the SQL reader,
  merge, GC, index build) raises `CorruptWalEntryError` / `CorruptManifestError` naming the file
  (jobs over many regions: inside `CorruptRegionsError`, after the healthy regions), `status` lists
  it; nothing corrupt is ever skipped silently (`test_corrupt_regions.py`);
* a table directory with foreign files: ignored by readers, writers and jobs, and never deleted;
* a huge batch (slow: hundreds of MB) is written in bounded memory, measured in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import timedelta
from typing import Any

import datafusion
import lance
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cases import backend, cases
from support.figures import case_name, record
from support.optional import not_none
from support.reference import stored_rows
from support.wal_oracle import apply_rows

import memwal_df as mw
from memwal_df import errors
from memwal_df.format import layout
from memwal_df.format.rows import wal_schema
from memwal_df.format.wal import Wal, encode_entry

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.string())])
GUARANTEE = "bad input never corrupts a table; nothing corrupt is read"


def sql_rows(uri: str, options: dict[str, str] | None, pk: str = "id") -> dict[Any, dict[str, Any]]:
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri, storage_options=options))
    rows = ctx.sql("SELECT * FROM t").to_arrow_table().to_pylist()
    out = {r[pk]: r for r in rows}
    assert len(out) == len(rows), "the reader returned a key twice"
    return out


def new_table(uri: str, options: dict[str, str] | None = None, spec: bool = True) -> mw.Table:
    """The base rows in a table with region spec bucket(id, 4), or without a spec (`spec=False`:
    regions created by hand)."""
    base = pa.table({"id": pa.array([1, 2, 3], pa.int64()), "v": ["b1", "b2", "b3"]})
    region_spec = mw.bucket("id", 4) if spec else None
    return mw.create_table(uri, base, "id", region_spec=region_spec, storage_options=options)


BASE = {k: {"id": k, "v": f"b{k}"} for k in (1, 2, 3)}


# ---------------------------------------------------------------------------------------------------
# Null, duplicate and wrongly typed keys
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", cases([("local",)], [("local",), ("s3",)]))
def test_duplicate_keys_in_one_batch_last_row_wins_through_flush_and_merge(request, tmp_path, kind):
    uri, options = backend(request, kind, tmp_path)
    table = new_table(uri, options)
    model = {k: dict(v) for k, v in BASE.items()}
    batches = [
        pa.table({"id": pa.array([5, 1, 5, 7, 1, 5], pa.int64()), "v": ["a", "b", "c", "d", "e", "f"]}),
        pa.table({"id": pa.array([7, 7, 2], pa.int64()), "v": ["g", None, "h"]}),
    ]
    with table.writer() as w:
        for batch in batches:
            w.put(batch)
            apply_rows(model, [{**r, "_tombstone": False} for r in batch.to_pylist()])
        w.delete([3, 3, 9, 3])  # duplicate and unknown keys in one delete
        apply_rows(model, [{"id": 3, "v": None, "_tombstone": True}])
    assert stored_rows(table) == model
    assert sql_rows(uri, options) == model
    table.merge()
    base = table.dataset.to_table().to_pylist()
    assert len({r["id"] for r in base}) == len(base), "the merge left a key twice in the base"
    assert {r["id"]: r for r in base} == model
    assert sql_rows(uri, options) == model


BATCHES = st.lists(
    st.lists(st.tuples(st.integers(0, 12), st.none() | st.text(max_size=3)), min_size=1, max_size=12),
    min_size=1,
    max_size=4,
)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=BATCHES, deletes=st.lists(st.integers(0, 12), max_size=6), flush_every=st.integers(1, 3))
def test_batches_with_duplicate_keys_match_the_model(tmp_path_factory, batches, deletes, flush_every):
    """Random batches full of duplicate keys (and NULL values), a delete with duplicates, flushes in
    between, then a merge: the stored rows and the SQL reader equal a dict model where the last row
    of a key wins, and the base keeps one row per key."""
    uri = str(tmp_path_factory.mktemp("dup") / "t")
    table = new_table(uri)
    model = {k: dict(v) for k, v in BASE.items()}
    with table.writer(max_memtable_rows=7) as w:
        for i, rows in enumerate(batches):
            data = pa.table({"id": pa.array([k for k, _ in rows], pa.int64()), "v": [v for _, v in rows]})
            w.put(data)
            apply_rows(model, [{**r, "_tombstone": False} for r in data.to_pylist()])
            if i % flush_every == 0:
                w.flush()
        if deletes:
            w.delete(deletes)
            apply_rows(model, [{"id": k, "v": None, "_tombstone": True} for k in deletes])
    assert stored_rows(table) == model
    assert sql_rows(uri, None) == model
    table.merge()
    base = table.dataset.to_table().to_pylist()
    assert sorted(r["id"] for r in base) == sorted(model)
    assert sql_rows(uri, None) == model


@pytest.mark.parametrize("writer", ["routed", "region"])
@pytest.mark.parametrize(
    "bad, error",
    [
        (
            pa.table({"id": pa.array([4, None, 6], pa.int64()), "v": ["x", "y", "z"]}),
            errors.NullPrimaryKeyError,
        ),
        (pa.table({"id": ["4"], "v": ["x"]}), errors.SchemaMismatchError),  # string for int64
        (pa.table({"id": pa.array([4], pa.int64()), "v": [b"\xff"]}), errors.SchemaMismatchError),
        (pa.table({"id": pa.array([4.5]), "v": ["x"]}), errors.SchemaMismatchError),  # lossy cast
        (pa.table({"ID": pa.array([4], pa.int64()), "v": ["x"]}), errors.SchemaMismatchError),
        (pa.table({"id": pa.array([4], pa.int64()), "v": [["x"]]}), errors.SchemaMismatchError),
    ],
    ids=["null-key", "string-key", "binary-value", "lossy-key", "wrong-name", "list-value"],
)
def test_bad_puts_are_typed_errors_and_write_nothing(tmp_path, writer, bad, error):
    """A batch mixing good rows of several regions with one bad row writes none of them."""
    table = new_table(str(tmp_path / "t"), spec=writer == "routed")
    if writer == "routed":
        w: Any = table.writer()
    else:
        w = table.region_writer(uuid.uuid4())  # a manual region: no routing check, same validation
    with pytest.raises(error):
        w.put(bad)
    w.close()
    assert stored_rows(table) == BASE


@pytest.mark.parametrize(
    "keys, error",
    [
        (pa.array([1, None], pa.int64()), errors.NullPrimaryKeyError),
        (["a"], errors.SchemaMismatchError),
        (pa.table({"nope": [1]}), errors.SchemaMismatchError),
        (pa.table({"id": pa.array([1], pa.int64()), "v": ["x"]}), errors.SchemaMismatchError),
    ],
    ids=["null", "string", "wrong-column", "non-key-column"],
)
def test_bad_deletes_are_typed_errors(tmp_path, keys, error):
    table = new_table(str(tmp_path / "t"))
    with table.writer() as w, pytest.raises(error):
        w.delete(keys)
    assert stored_rows(table) == BASE


# ---------------------------------------------------------------------------------------------------
# Whole rows only: a put lacking a column, vectors of another dimension, malformed region ids
# ---------------------------------------------------------------------------------------------------

DIM = 3
VEC_TYPE = pa.list_(pa.float32(), DIM)


def vec_table(uri: str, options: dict[str, str] | None, spec: bool) -> mw.Table:
    """A table with a nullable vector column, three base rows, bucketed by `id` if `spec`."""
    base = pa.table(
        {
            "id": pa.array([1, 2, 3], pa.int64()),
            "v": ["b1", "b2", "b3"],
            "vec": pa.array([[k, 0.5, -1.0] for k in (1, 2, 3)], VEC_TYPE),
        }
    )
    return mw.create_table(
        uri, base, "id", region_spec=mw.bucket("id", 4) if spec else None, storage_options=options
    )


VEC_BASE = {k: {"id": k, "v": f"b{k}", "vec": [float(k), 0.5, -1.0]} for k in (1, 2, 3)}
PARTIAL = pa.table({"id": pa.array([2, 5, 6, 7, 8], pa.int64()), "v": ["x", "y", "z", "w", "u"]})
PARTIAL_INPUTS = {
    "table": lambda: PARTIAL,
    "record_batch": lambda: PARTIAL.to_batches()[0],
    "reader": lambda: pa.RecordBatchReader.from_batches(PARTIAL.schema, PARTIAL.to_batches(max_chunksize=2)),
    "pandas": lambda: PARTIAL.to_pandas(),
    "dict": lambda: PARTIAL.to_pydict(),
    "rows": lambda: PARTIAL.to_pylist(),
}


def open_writer(table: mw.Table, kind: str) -> Any:
    """The routed writer (`routed`) or a region writer of a table without a spec (`region`)."""
    return table.writer() if kind == "routed" else table.region_writer(uuid.uuid4())


def recovered_rows(table: mw.Table, w: Any) -> dict[Any, dict[str, Any]]:
    """The table's rows after `w` crashed (aborted) and its regions were recovered: whatever reached
    the WAL is in them."""
    w.abort()
    table.recover()
    return stored_rows(table)


@pytest.mark.parametrize("writer", ["routed", "region"])
@pytest.mark.parametrize("kind", list(PARTIAL_INPUTS))
def test_a_put_lacking_a_column_is_refused_and_writes_nothing(
    request, table_uri, table_storage_options, writer, kind
):
    """A put replaces whole rows, so data without the (nullable) vector column would erase the vectors
    of the keys it names: it is refused with `MissingColumnsError` naming the column, for every input
    kind (a RecordBatchReader before its first batch is read) and both writers, and no region
    receives a row, not even in its WAL."""
    table = vec_table(table_uri, table_storage_options, spec=writer == "routed")
    w = open_writer(table, writer)
    data = PARTIAL_INPUTS[kind]()
    with pytest.raises(errors.MissingColumnsError, match=r"lacks the columns of the table \['vec'\]") as e:
        w.put(data)
    assert e.value.columns == ("vec",) and isinstance(e.value, errors.SchemaMismatchError)
    if kind == "reader":
        assert data.read_all().num_rows == PARTIAL.num_rows  # not a batch was consumed
    assert recovered_rows(table, w) == VEC_BASE
    record(GUARANTEE, case_name(request), refused_puts=1, rows_checked=len(VEC_BASE))


def test_a_put_with_explicit_nulls_clears_a_column(tmp_path):
    """The way to clear a column: give it, with NULLs."""
    table = vec_table(str(tmp_path / "t"), None, spec=True)
    with table.writer() as w:
        w.put(PARTIAL.append_column("vec", pa.nulls(PARTIAL.num_rows, VEC_TYPE)))
        w.delete(PARTIAL.select(["id"]).slice(4))  # deletes need the key columns only
    want = {**VEC_BASE, **{r["id"]: {**r, "vec": None} for r in PARTIAL.slice(0, 4).to_pylist()}}
    assert stored_rows(table) == want == sql_rows(table.uri, None)


def test_spark_writes_check_columns_as_the_table_writer(tmp_path):
    """The Spark write paths use the table writer's checks (no Spark session needed here): the
    driver's check of a DataFrame's columns and a task's staging of unrouted rows refuse data
    lacking a column, naming it, and stage nothing."""
    pytest.importorskip("pyspark")
    from memwal_df.spark.routing import check_routable
    from memwal_df.spark.staging import RegionStage, stage_batches

    table = vec_table(str(tmp_path / "t"), None, spec=True)
    with pytest.raises(errors.MissingColumnsError, match=r"\['vec'\]"):
        check_routable(table, PARTIAL.column_names, keys_only=False)
    with pytest.raises(errors.MissingColumnsError, match=r"\['id'\]"):
        check_routable(table, [], keys_only=True)
    with pytest.raises(errors.SchemaMismatchError, match=r"not in the primary key: \['v'\]"):
        check_routable(table, ["id", "v"], keys_only=True)
    check_routable(table, ["vec", "id", "v"], keys_only=False)
    with RegionStage(table.schema.schema, 1 << 20) as stage:
        with pytest.raises(errors.MissingColumnsError, match=r"\['vec'\]"):
            stage_batches(table, PARTIAL.to_batches(), "upsert", stage)
        assert stage.regions == []


@pytest.mark.parametrize("writer", ["routed", "region"])
@pytest.mark.parametrize(
    "vec, given",
    [
        (pa.array([[1, 2]] * 5, pa.list_(pa.float32(), 2)), "2"),  # a fixed-size list of another size
        (pa.array([[1, 2, 3, 4]] * 5, pa.list_(pa.float32())), "4"),
        (pa.array([[1, 2, 3]] * 4 + [[1, 2, 3, 4, 5]], pa.list_(pa.float64())), "5"),  # one ragged row
        (pa.array([[1, 2], None, [1, 2, 3], [1], [1, 2, 3]], pa.large_list(pa.float32())), "1 / 2"),
    ],
    ids=["fixed-2", "list-4", "ragged-5", "ragged-1-2"],
)
def test_vectors_of_another_dimension_are_refused_naming_both(tmp_path, writer, vec, given):
    """A vector column given lists of another length (or of mixed lengths) is refused with
    `SchemaMismatchError` naming the column, the table's dimension and the given one(s)."""
    table = vec_table(str(tmp_path / "t"), None, spec=writer == "routed")
    w = open_writer(table, writer)
    with pytest.raises(
        errors.SchemaMismatchError,
        match=rf"column 'vec' holds vectors of dimension {DIM}; the data has lists of {given} values",
    ):
        w.put(PARTIAL.append_column("vec", vec))
    assert recovered_rows(table, w) == VEC_BASE


def test_a_wal_entry_with_vectors_of_another_dimension_is_corrupt(tmp_path):
    """A WAL entry (written by another program) whose vectors have another dimension than the
    table's is a `CorruptWalEntryError` naming the file when a writer claims the region."""
    table = vec_table(str(tmp_path / "t"), None, spec=False)
    region = uuid.uuid4()
    table.region_writer(region).close()
    other = pa.schema(
        [pa.field("id", pa.int64(), nullable=False), ("v", pa.string()), ("vec", pa.list_(pa.float32(), 2))]
    )
    rows = pa.RecordBatch.from_pydict(
        {"id": [9], "v": ["x"], "vec": [[1.0, 2.0]], "_tombstone": [False]},
        schema=wal_schema(other, table.schema.field_ids),
    )
    m = not_none(table.region_status(region))
    position = m.wal_entry_position_last_seen + 1
    Wal(table.storage, region).append(position, encode_entry([rows], m.writer_epoch, m.current_generation))
    with pytest.raises(errors.CorruptWalEntryError, match="does not match the table schema") as e:
        table.region_writer(region)
    assert e.value.path == layout.wal_path(region, position)


@pytest.mark.parametrize("writer", ["routed", "region"])
def test_lists_of_strings_are_no_vectors(tmp_path, writer):
    """List columns convert only if their values do: strings that look like numbers are refused."""
    table = vec_table(str(tmp_path / "t"), None, spec=writer == "routed")
    w = open_writer(table, writer)
    with pytest.raises(errors.SchemaMismatchError, match="column 'vec' has type list<item: string>"):
        w.put(PARTIAL.append_column("vec", pa.array([["1", "2", "3"]] * PARTIAL.num_rows)))
    assert recovered_rows(table, w) == VEC_BASE


@pytest.mark.parametrize("region_id", ["not-a-uuid", "", 42, None])
def test_a_malformed_region_id_is_a_typed_error_naming_the_argument(tmp_path, region_id):
    table = vec_table(str(tmp_path / "t"), None, spec=False)
    with pytest.raises(
        errors.InvalidArgumentError, match=rf"^region_id must be a region id.*got {region_id!r}$"
    ):
        table.region_writer(region_id)
    assert table.region_ids() == []


# ---------------------------------------------------------------------------------------------------
# Every primary key type Lance 14 accepts
# ---------------------------------------------------------------------------------------------------

KEY_TYPES: dict[str, tuple[pa.DataType, list[Any]]] = {
    "int8": (pa.int8(), [-128, -1, 0, 1, 127]),
    "int16": (pa.int16(), [-32768, 0, 32767, 5, -5]),
    "int32": (pa.int32(), [-(2**31), 0, 2**31 - 1, 7, -7]),
    "int64": (pa.int64(), [-(2**63), 0, 2**63 - 1, 9, -9]),
    "uint8": (pa.uint8(), [0, 1, 128, 255, 2]),
    "uint16": (pa.uint16(), [0, 1, 65535, 300, 2]),
    "uint32": (pa.uint32(), [0, 1, 2**32 - 1, 2**31, 2]),
    "uint64": (pa.uint64(), [0, 1, 2**64 - 1, 2**63, 2]),
    "bool": (pa.bool_(), [True, False]),
    "string": (pa.string(), ["", "a", "é\u0000x", "🦆" * 50, "A"]),
    "large_string": (pa.large_string(), ["", "z", "x" * 1000, "ü", "Z"]),
    "binary": (pa.binary(), [b"", b"\x00", b"\xff\x00\xff", b"a" * 300, b"\x00\x00"]),
    "large_binary": (pa.large_binary(), [b"", b"\x01", b"\x00" * 64, b"\xfe", b"\x01\x00"]),
}
SAMPLE_TYPES = ("int8", "uint64", "large_binary")


@pytest.mark.parametrize(
    "name",
    [
        n if n in ("int8", "uint64", "large_binary") else pytest.param(n, marks=pytest.mark.slow)
        for n in KEY_TYPES
    ],
)
def test_every_primary_key_type_round_trips(tmp_path, request, name):
    """put, delete, a crash and replay, flush, overwrite, merge: the SQL reader and the stored rows
    equal the model at each step, and the base keeps one row per key."""
    key_type, keys = KEY_TYPES[name]
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("k", key_type, nullable=False), pa.field("v", pa.int64())])
    table = mw.create_table(uri, schema, "k", region_spec=mw.bucket("k", 2) if name != "bool" else None)
    model: dict[Any, dict[str, Any]] = {}

    def put(ks: list[Any], tag: int) -> pa.Table:
        data = pa.table({"k": pa.array(ks, key_type), "v": pa.array([tag * 100 + i for i in range(len(ks))])})
        apply_rows(model, [{**r, "_tombstone": False} for r in data.to_pylist()], key="k")
        return data

    def delete(ks: list[Any]) -> pa.Array:
        apply_rows(model, [{"k": k, "v": None, "_tombstone": True} for k in ks], key="k")
        return pa.array(ks, key_type)

    def writer() -> Any:
        return table.writer() if table.spec is not None else table.region_writer(REGION)

    w = writer()
    w.put(put(keys, 1))
    w.delete(delete(keys[:1]))
    w.abort()  # a crash: recovery claims, replays and flushes the regions
    assert table.recover()
    assert sql_rows(uri, None, "k") == model
    w = writer()
    w.put(put(list(reversed(keys)), 2))
    w.delete(delete(keys[-1:]))
    w.close()
    assert stored_rows(table) == model
    assert sql_rows(uri, None, "k") == model
    table.merge()
    base = table.dataset.to_table().to_pylist()
    assert len(base) == len(model) and {r["k"]: r for r in base} == model
    assert sql_rows(uri, None, "k") == model
    record(GUARANTEE, case_name(request), key_types=1, rows_checked=len(model))


REGION = uuid.UUID("00000000-0000-4000-8000-00000000b001")


# ---------------------------------------------------------------------------------------------------
# Corrupt files: every entry point names them
# ---------------------------------------------------------------------------------------------------


def _flip(data: bytes) -> bytes:
    """Bytes flipped in the middle (not the end-of-stream marker)."""
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0xA5 for b in data[mid : mid + 16]) + data[mid + 16 :]


CORRUPTIONS = {
    "wal-truncated": ("wal", lambda d: d[: len(d) - 9]),
    "wal-flipped": ("wal", _flip),
    "wal-empty": ("wal", lambda d: b""),
    "manifest-truncated": ("manifest", lambda d: d[: len(d) // 2]),
    "manifest-garbage": ("manifest", lambda d: b"\xff" * len(d)),
    "manifest-other-version": ("manifest", None),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
@pytest.mark.parametrize("kind", cases([("local",)], [("local",), ("s3",)]))
def test_corrupt_files_raise_typed_errors_naming_them(request, tmp_path, kind, case):
    uri, options = backend(request, kind, tmp_path)
    what, damage = CORRUPTIONS[case]
    table = new_table(uri, options)
    with table.writer() as w:  # flushed generations in every region
        w.put(pa.table({"id": pa.array(range(40), pa.int64()), "v": [f"x{i}" for i in range(40)]}))
    rid = table.region_ids()[0]
    rw = table.region_writer(rid)
    rw.delete(rw_keys(table, rid))  # two WAL entries past the flushed ones: the first gets corrupted
    rw.put(pa.table({"id": pa.array(rw_keys(table, rid), pa.int64()), "v": ["again"] * 2}))
    position = rw.stats()["next_wal_position"] - 2
    rw.abort()
    manifest = not_none(table.region_status(rid)).manifest_version
    path = layout.wal_path(rid, position) if what == "wal" else layout.manifest_path(rid, manifest)
    data = table.storage.get(path)
    if damage is None:  # a valid manifest of another version in this version's place
        data = table.storage.get(layout.manifest_path(rid, manifest - 1))
    else:
        data = damage(data)
    table.storage.put(path, data)
    expected = errors.CorruptWalEntryError if what == "wal" else errors.CorruptManifestError
    entry_points = {
        "claim": lambda: table.region_writer(rid),
        "recover": table.recover,
        "routed write": lambda: _routed_write(table, rid),
    }
    if what == "manifest":
        entry_points |= {"merge": table.merge, "gc": table.gc, "index build": table.build_index}
    for name, call in entry_points.items():
        with pytest.raises((expected, errors.CorruptRegionsError)) as e:
            call()
        error = e.value.errors[rid] if isinstance(e.value, errors.CorruptRegionsError) else e.value
        assert isinstance(error, expected) and error.path == path, f"{name}: {e.value}"
        assert path in str(e.value)
    (problem,) = table.status()["corrupt_regions"]  # status reports the file instead of raising
    assert (problem.region_id, problem.path) == (rid, path)
    if what == "manifest":  # DataFusion wraps what a table provider raises: the message names both
        with pytest.raises(Exception, match=f"{expected.__name__}.*{path}"):
            sql_rows(uri, options)
    record(
        GUARANTEE,
        case_name(request),
        corrupt_files=1,
        entry_points_checked=len(entry_points) + 1 + (what == "manifest"),
    )


def rw_keys(table: mw.Table, rid: uuid.UUID) -> list[int]:
    """Two keys of region `rid`."""
    keys = pa.table({"id": pa.array(range(1000), pa.int64())})
    values = not_none(table.spec).evaluate(keys, table.schema.field_ids)[0].to_pylist()
    mine = [k for k, v in zip(range(1000), values, strict=True) if table.region_id_for((v,)) == rid]
    return mine[:2]


def _routed_write(table: mw.Table, rid: uuid.UUID) -> None:
    with table.writer() as w:
        w.put(pa.table({"id": pa.array(rw_keys(table, rid), pa.int64()), "v": ["w", "w"]}))


# ---------------------------------------------------------------------------------------------------
# Foreign files in the table directory
# ---------------------------------------------------------------------------------------------------

FOREIGN = [
    "README.txt",
    "_mem_wal/README.txt",
    "_mem_wal/not-a-region/manifest/0100000000000000000000000000000000000000000000000000000000000000.binpb",
    "_mem_wal/{rid}/notes.txt",
    "_mem_wal/{rid}/manifest/backup.json",
    "_mem_wal/{rid}/manifest/0100000000000000000000000000000000000000000000000000000000000000.binpb.bak",
    "_mem_wal/{rid}/wal/README",
    "_mem_wal/{rid}/wal/1.arrow",
    "_mem_wal/{rid}/gen_1/data.lance",
    "_mem_wal/{rid}/ABCDEF01_gen_1/x",
]


@pytest.mark.parametrize("kind", cases([("local",)], [("local",), ("s3",)]))
def test_foreign_files_are_ignored_and_kept(request, tmp_path, kind):
    uri, options = backend(request, kind, tmp_path)
    table = new_table(uri, options)
    model = {k: dict(v) for k, v in BASE.items()}
    with table.writer() as w:
        data = pa.table({"id": pa.array(range(10, 30), pa.int64()), "v": [f"x{i}" for i in range(20)]})
        w.put(data)
        apply_rows(model, [{**r, "_tombstone": False} for r in data.to_pylist()])
    rid = table.region_ids()[0]
    foreign = [p.format(rid=rid) for p in FOREIGN]
    for p in foreign:
        table.storage.put(p, b"not memwal_df's")
    with table.writer() as w:
        w.delete(list(range(10, 15)))
        apply_rows(model, [{"id": k, "v": None, "_tombstone": True} for k in range(10, 15)])
    assert table.recover() == []
    assert stored_rows(table) == model
    assert sql_rows(uri, options) == model
    table.merge()
    table.build_index()
    table.gc(grace=timedelta(0))
    assert sql_rows(uri, options) == model
    assert table.status()["regions"]
    assert all(table.storage.get(p) == b"not memwal_df's" for p in foreign), "a foreign file was touched"
    record(GUARANTEE, case_name(request), foreign_files=len(foreign), rows_checked=len(model))


# ---------------------------------------------------------------------------------------------------
# Huge batches: memory stays bounded
# ---------------------------------------------------------------------------------------------------

HUGE_CHILD = r"""
import json, sys
import numpy as np, pyarrow as pa
import memwal_df as mw

def rss(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) / 1024

uri, mb, limit_mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = mb * 1024 * 1024 // 264
offsets = np.arange(rows + 1, dtype=np.int32) * 256
payload = pa.BinaryArray.from_buffers(
    pa.binary(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(np.full(rows * 256, 120, np.uint8))]
)
batch = pa.table({"id": pa.array(np.arange(rows, dtype=np.int64)), "v": payload})
schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("v", pa.binary())])
table = mw.create_table(uri, schema, "id")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS, which holds the input batch
before = rss("VmRSS")
with table.region_writer("00000000-0000-4000-8000-000000000001", max_unflushed_memtable_bytes=limit_mb << 20,
                         max_memtable_size=(limit_mb << 20) // 4) as w:
    w.put(batch)
print(json.dumps({"rows": rows, "input_mb": batch.nbytes / 2**20, "rss_before_mb": before,
                  "peak_rss_mb": rss("VmHWM")}))
"""


@pytest.mark.parametrize("mb", [32, pytest.param(400, marks=pytest.mark.slow)])
def test_huge_batch_is_written_in_bounded_memory(tmp_path, request, mb):
    """One put of `mb` MB through a durable region writer whose unflushed MemTables may hold 64 MB:
    the write is chunked (`max_memtable_rows`), backpressure holds MemTables to the limit, and the
    peak RSS of the process stays within the input itself plus a bounded working set, whatever `mb`."""
    uri = str(tmp_path / "t")
    out = subprocess.run(
        [sys.executable, "-c", HUGE_CHILD, uri, str(mb), "64"], capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout)
    table = mw.open_table(uri)
    assert table.dataset.count_rows() == 0
    rid = table.region_ids()[0]
    status = not_none(table.region_status(rid))
    assert sum(1 for _ in status.flushed_generations) >= 1
    got = flushed_row_count(table)
    assert got == m["rows"]
    added = m["peak_rss_mb"] - m["rss_before_mb"]  # the input batch is already in rss_before
    record(
        GUARANTEE,
        case_name(request) + f"[{mb}MB]",
        rows_checked=got,
        input_mb=round(m["input_mb"]),
        peak_rss_mb=round(m["peak_rss_mb"]),
        peak_rss_added_by_write_mb=round(added),
    )
    # What the write adds must not grow with the input: a few MemTable limits (64 MB) of working set
    # plus the WAL encoding of one chunk, not a copy of the whole batch.
    assert added < 300, m  # a copy of the 400 MB input would not fit


def flushed_row_count(table: mw.Table) -> int:
    """Rows in the flushed generations of every region."""
    total = 0
    for rid in table.region_ids():
        for _, path in not_none(table.region_status(rid)).flushed_generations:
            total += lance.dataset(table.storage.child_uri(layout.generation_path(rid, path))).count_rows()
    return total


# ---------------------------------------------------------------------------------------------------
# Type conversions: decided by the input's type, never by its values (docs/writing.md, "Types")
# ---------------------------------------------------------------------------------------------------

VEC2 = pa.list_(pa.float32(), 2)
# (column type, input values, the value stored, or the words of the SchemaMismatchError)
CONVERSIONS: list[tuple[pa.DataType, pa.Array, Any]] = [
    (pa.int64(), pa.array([4.0]), "has type double, the table has int64: floating-point values are never"),
    (pa.int64(), pa.array([1.5]), "has type double, the table has int64"),
    (pa.int32(), pa.array([4.0], pa.float32()), "the table has int32: floating-point values are never"),
    (pa.int64(), pa.array([-3], pa.int8()), -3),
    (pa.int32(), pa.array([7]), 7),
    (pa.int32(), pa.array([2**40]), "of type int64 cannot be converted to the table's int32"),
    (pa.uint8(), pa.array([-1]), "of type int64 cannot be converted to the table's uint8"),
    (pa.float64(), pa.array([3]), 3.0),
    (pa.float32(), pa.array([2**20]), float(2**20)),
    (pa.float32(), pa.array([2**30 + 1]), "of type int64 cannot be converted to the table's float"),
    (pa.float32(), pa.array([1.5]), 1.5),
    (pa.float32(), pa.array([1e300]), "of type double has values out of the range of the table's float"),
    (pa.float64(), pa.array([0.25], pa.float32()), 0.25),
    (VEC2, pa.array([[1, 2]]), [1.0, 2.0]),
    (VEC2, pa.array([[1e300, 0.0]]), "has values out of the range of the table's fixed_size_list"),
    (pa.list_(pa.int64()), pa.array([[1.0, 2.0]]), "the table has list<item: int64>"),
]


@pytest.mark.parametrize(("column", "values", "expected"), CONVERSIONS)
@pytest.mark.parametrize("form", ["arrow", "rows", "columns"])
def test_conversions_follow_the_column_and_input_types(tmp_path, column, values, expected, form) -> None:
    """Each input form (an Arrow table, a list of row dicts, a dict of columns: the Python values
    take Arrow's inferred type) is accepted or refused by the types alone, with a SchemaMismatchError
    naming the column and both types; out-of-range values of an accepted type are refused too."""
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("c", column)])
    table = mw.create_table(str(tmp_path / "t"), schema, "id")
    data: Any = pa.table({"id": pa.array([1], pa.int64()), "c": values})
    if form == "rows":
        data = data.to_pylist()
    elif form == "columns":
        data = data.to_pydict()
    with table.writer() as w:
        if isinstance(expected, str):
            with pytest.raises(errors.SchemaMismatchError) as raised:
                w.put(data)
            assert "column 'c'" in str(raised.value) and expected in str(raised.value)
            return
        w.put(data)
    got = mw.MemWalTable(table).to_table().to_pylist()
    assert got == [{"id": 1, "c": expected}]


def test_keys_and_conditions_follow_the_same_rules(tmp_path) -> None:
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("n", pa.int32()), ("x", pa.float64())])
    table = mw.create_table(str(tmp_path / "t"), schema, "id")
    with table.writer() as w:
        w.put({"id": [1, 2], "n": [10, 20], "x": [0.5, 1.5]})
        with pytest.raises(errors.SchemaMismatchError, match="has type double, the table has int64"):
            w.delete([2.0])
        with pytest.raises(errors.InvalidConditionError, match="'n' has type double, the table has int32"):
            w.put({"id": [1], "n": [11], "x": [0.5]}, partial=True, if_match={"n": 10.0})
        applied = w.put({"id": [1], "x": [2.5]}, partial=True, if_match={"n": 10, "x": 0})  # ints for floats
        assert applied is not None
        w.delete([2])
    assert mw.MemWalTable(table).to_table().to_pylist() == [{"id": 1, "n": 10, "x": 0.5}]
