"""The primary-key sidecar index of a flushed generation: `{generation}/_pk_index/`.

Lance 14 writes it with `train_btree_index(stream, store, 8192)` into a `LanceIndexStore`, whose
files are always Lance file format **v2.0** (footer version 0.3), whatever the table's data version.
Both files are absent from the generation's manifest; readers open them by path.

```
page_data.lance    values: <K> (nullable), ids: uint64 not null
                   one row per generation row (duplicates and tombstones included), sorted by
                   (value, id); ids are row offsets in fragment 0 (= forward write order);
                   written one record batch per page: pages are consecutive runs of 8192 rows.
page_lookup.lance  min: <K>, max: <K> (nullable), null_count: uint32 not null, page_idx: uint32 not null
                   one row per page: its first value, its last value, its null count, its number;
                   schema metadata {"batch_size": "8192", "range_partitioned": "false"}.
```
`<K>` is the key's Arrow type for a single-column key and `binary` (the order-preserving tuple
encoding of `encode_composite_keys`) for a composite key.

Lance 14.0.2 accepts primary keys of type int8/16/32/64, uint8/16/32/64, bool, utf8, large_utf8,
binary and large_binary only, and never nullable ones.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lance.file import LanceFileReader, LanceFileWriter

from memwal_df.errors import NotFoundError
from memwal_df.format.layout import PK_INDEX_DIR

__all__ = [
    "PAGE_DATA_FILE",
    "PAGE_LOOKUP_FILE",
    "PK_INDEX_BATCH_SIZE",
    "canonical_lookup_bytes",
    "encode_composite_keys",
    "is_supported_pk_type",
    "lookup",
    "pk_index_key",
    "read_pk_index",
    "sort_pk_index",
    "write_pk_index",
]

PAGE_DATA_FILE = "page_data.lance"
PAGE_LOOKUP_FILE = "page_lookup.lance"
PK_INDEX_BATCH_SIZE = 8192
_FILE_VERSION = "2.0"  # LanceIndexStore::new always uses ConcreteFileVersion::V2_0

# The two schema-metadata entries of page_lookup.lance as protobuf map entries (field 5 of the
# Lance Schema message). Lance keeps metadata in a HashMap, so it emits them in a random order.
_BATCH_SIZE_ENTRY = b"\x2a\x12\x0a\x0abatch_size\x12\x048192"
_RANGE_ENTRY = b"\x2a\x1a\x0a\x11range_partitioned\x12\x05false"
_FOOTER = struct.Struct("<QQQIIHH4s")  # Lance v2 footer: 40 bytes ending in b"LANC"

_SIGN_BIT = np.uint64(1 << 63)


def is_supported_pk_type(data_type: pa.DataType) -> bool:
    """Whether Lance 14.0.2 accepts `data_type` as a primary-key column type (flush rejects the rest)."""
    t = data_type
    return (
        pa.types.is_integer(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


# --------------------------------------------------------------------------------------------------
# Composite key encoding
# --------------------------------------------------------------------------------------------------


def _as_array(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column


def _valid_mask(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _is_fixed_width(t: pa.DataType) -> bool:
    return pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_date(t)


def _fixed_bytes(arr: pa.Array) -> np.ndarray | None:
    """Per-row big-endian value bytes (rows x width) of a fixed-width key column, or None if var-width.

    Signed integers and dates: i64 with the sign bit flipped; unsigned: u64; bool: one byte 0/1.
    """
    t = arr.type
    if pa.types.is_boolean(t):
        return pc.fill_null(arr, False).to_numpy(zero_copy_only=False).astype(np.uint8).reshape(-1, 1)
    if pa.types.is_signed_integer(t) or pa.types.is_date(t):
        as_int = arr.cast(pa.int32()) if pa.types.is_date32(t) else arr
        v = pc.fill_null(as_int.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        return (v.view(np.uint64) ^ _SIGN_BIT).astype(">u8").view(np.uint8).reshape(-1, 8)
    if pa.types.is_unsigned_integer(t):
        v = pc.fill_null(arr.cast(pa.uint64()), 0).to_numpy(zero_copy_only=False)
        return v.astype(">u8").view(np.uint8).reshape(-1, 8)
    return None


def _var_bytes(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64[n+1] starting at 0, data uint8) of a string/binary key column."""
    t = arr.type
    if not (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
    ):
        raise TypeError(
            f"unsupported primary-key type {t} for a composite key (Lance encodes integers, dates, "
            "bool, strings and binaries only)"
        )
    big = arr.cast(pa.large_binary())
    n = len(big)
    _, off_buf, data_buf = big.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int64, count=big.offset + n + 1)[big.offset :]
    start, end = int(offsets[0]), int(offsets[-1])
    data = np.frombuffer(data_buf, dtype=np.uint8, count=end)[start:] if end else np.empty(0, np.uint8)
    return offsets - start, data


class _ColumnEncoder:
    """Order-preserving encoding of one key column: `0x00` for null, else `0x01` + the value bytes."""

    def __init__(self, column: pa.Array) -> None:
        arr = _as_array(column)
        self.n = len(arr)
        self.valid = _valid_mask(arr)
        self.fixed = _fixed_bytes(arr)
        if self.fixed is not None:
            self.lengths = np.where(self.valid, 1 + self.fixed.shape[1], 1).astype(np.int64)
            return
        # Strings and binaries: every 0x00 becomes 0x00 0xff, then a 0x00 0x00 terminator.
        self.offsets, self.data = _var_bytes(arr)
        row_len = np.diff(self.offsets)
        self.row_of_byte = np.repeat(np.arange(self.n, dtype=np.int64), row_len)
        self.is_zero = self.data == 0
        self.zeros_before = np.concatenate(([0], np.cumsum(self.is_zero, dtype=np.int64)))
        zeros_in_row = self.zeros_before[self.offsets[1:]] - self.zeros_before[self.offsets[:-1]]
        self.lengths = np.where(self.valid, 1 + row_len + zeros_in_row + 2, 1).astype(np.int64)

    def write(self, out: np.ndarray, start: np.ndarray) -> None:
        """Write every row's encoding into `out` at `start[row]`; `out` must be zero-filled."""
        valid = self.valid
        out[start[valid]] = 1
        if self.fixed is not None:
            width = self.fixed.shape[1]
            dest = start[valid, None] + 1 + np.arange(width, dtype=np.int64)
            out[dest] = self.fixed[valid]
            return
        if self.data.size == 0:
            return
        # Byte i of row r lands at start[r] + 1 + (i - offsets[r]) + (zeros in row r before i).
        row_base = start + 1 - self.offsets[:-1] - self.zeros_before[self.offsets[:-1]]
        dest = row_base[self.row_of_byte] + np.arange(self.data.size, dtype=np.int64)
        dest += self.zeros_before[:-1]
        keep = valid[self.row_of_byte]
        out[dest[keep]] = self.data[keep]
        out[dest[keep & self.is_zero] + 1] = 0xFF


def encode_composite_keys(columns: Sequence[pa.Array]) -> pa.BinaryArray:
    """Lance's order-preserving tuple encoding of the key columns (given in primary-key order).

    Per column: `0x00` for null, else `0x01` + the value, where signed integers and dates are
    8-byte big-endian with the sign bit flipped, unsigned integers 8-byte big-endian, bool one byte,
    and strings/binaries have each `0x00` escaped as `0x00 0xff` and end with `0x00 0x00`.
    Unsigned byte order of the results is the tuple order. Floats and other types raise TypeError.
    Dates and fixed-size binaries follow Lance's encoder, though Lance 14.0.2 refuses them as keys.
    """
    if not columns:
        raise ValueError("a composite key needs at least one column")
    encoders = [_ColumnEncoder(c) for c in columns]
    n = encoders[0].n
    if any(e.n != n for e in encoders):
        raise ValueError("key columns differ in length")
    row_len = np.zeros(n, dtype=np.int64)
    for e in encoders:
        row_len += e.lengths
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(row_len, out=offsets[1:])
    total = int(offsets[-1])
    if total > np.iinfo(np.int32).max:
        raise ValueError(f"{total} bytes of encoded keys do not fit a binary array")
    out = np.zeros(total, dtype=np.uint8)
    start = offsets[:-1].copy()
    for e in encoders:
        e.write(out, start)
        start += e.lengths
    return pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(out)]
    )


def pk_index_key(columns: Sequence[pa.Array]) -> pa.Array:
    """The index's key column: the key itself for one column, `encode_composite_keys` for several."""
    if len(columns) == 1:
        return _as_array(columns[0])
    return encode_composite_keys(columns)


# --------------------------------------------------------------------------------------------------
# Writing and reading
# --------------------------------------------------------------------------------------------------


def sort_pk_index(key_columns: Sequence[pa.Array]) -> tuple[pa.Array, np.ndarray]:
    """(values, ids) of the index over keys in forward write order: sorted by value, ties by id.

    ids are the row offsets (0..n-1); nulls, which Lance never stores in a key, sort first.
    """
    keys = pk_index_key(key_columns)
    order = pc.array_sort_indices(keys, null_placement="at_start")  # stable: ties keep id order
    return keys.take(order), order.to_numpy().astype(np.uint64)


def _page_data_schema(value_type: pa.DataType) -> pa.Schema:
    return pa.schema([pa.field("values", value_type), pa.field("ids", pa.uint64(), nullable=False)])


def _page_lookup_schema(value_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            pa.field("min", value_type),
            pa.field("max", value_type),
            pa.field("null_count", pa.uint32(), nullable=False),
            pa.field("page_idx", pa.uint32(), nullable=False),
        ],
        metadata={"batch_size": str(PK_INDEX_BATCH_SIZE), "range_partitioned": "false"},
    )


def canonical_lookup_bytes(data: bytes) -> bytes:
    """page_lookup.lance bytes with its two metadata entries in one fixed order (batch_size first).

    Lance emits schema metadata in HashMap order, so native files come in either order at random.
    Only the schema buffer (global buffer 0) is searched; bytes of other files come back unchanged.
    """
    if len(data) < _FOOTER.size:
        return data
    *_, gbo_start, n_global, _, _, _, magic = _FOOTER.unpack_from(data, len(data) - _FOOTER.size)
    if magic != b"LANC" or n_global == 0:
        return data
    pos, size = struct.unpack_from("<QQ", data, gbo_start)
    schema = data[pos : pos + size]
    swapped = _RANGE_ENTRY + _BATCH_SIZE_ENTRY
    at = schema.find(swapped)
    if at < 0 or schema.find(swapped, at + 1) >= 0:
        return data
    at += pos
    return data[:at] + _BATCH_SIZE_ENTRY + _RANGE_ENTRY + data[at + len(swapped) :]


def _local_path(uri: str) -> str | None:
    if uri.startswith("file://"):
        return uri[len("file://") :]
    return None if "://" in uri else uri


def _canonicalize_local(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    fixed = canonical_lookup_bytes(data)
    if fixed == data:
        return
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".page_lookup.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(fixed)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_pk_index(
    generation_uri: str,
    key_columns: Sequence[pa.Array],
    storage_options: dict[str, str] | None = None,
) -> None:
    """Write `{generation_uri}/_pk_index/` for a generation whose rows have these keys, in row order.

    `key_columns` are the primary-key columns in primary-key order, one entry per generation row
    (dedup-deleted rows and tombstones included). The files are byte-identical to Lance 14's. On
    local paths the lookup file's metadata entries are put in a fixed order, so equal keys give equal
    bytes; on object stores they keep the random order Lance's writer gives them (as native does).
    """
    values, ids = sort_pk_index(key_columns)
    n = len(values)
    if n == 0:
        raise ValueError("a primary-key index needs at least one key")
    base = f"{generation_uri.rstrip('/')}/{PK_INDEX_DIR}"
    data_schema = _page_data_schema(values.type)
    ids_arr = pa.array(ids, pa.uint64())
    starts = np.arange(0, n, PK_INDEX_BATCH_SIZE)
    ends = np.minimum(starts + PK_INDEX_BATCH_SIZE, n)

    writer = LanceFileWriter(
        f"{base}/{PAGE_DATA_FILE}", data_schema, version=_FILE_VERSION, storage_options=storage_options
    )
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        writer.write_batch(pa.record_batch([values[s:e], ids_arr[s:e]], schema=data_schema))
    writer.close()

    nulls = np.add.reduceat(np.asarray(values.is_null().to_numpy(zero_copy_only=False), np.uint32), starts)
    lookup_schema = _page_lookup_schema(values.type)
    lookup_batch = pa.record_batch(
        [
            values.take(pa.array(starts)),
            values.take(pa.array(ends - 1)),
            pa.array(nulls.astype(np.uint32), pa.uint32()),
            pa.array(np.arange(len(starts), dtype=np.uint32), pa.uint32()),
        ],
        schema=lookup_schema,
    )
    lookup_uri = f"{base}/{PAGE_LOOKUP_FILE}"
    writer = LanceFileWriter(
        lookup_uri, lookup_schema, version=_FILE_VERSION, storage_options=storage_options
    )
    writer.write_batch(lookup_batch)
    writer.close()
    local = _local_path(lookup_uri)
    if local is not None:
        _canonicalize_local(local)


def read_pk_index(
    generation_uri: str, storage_options: dict[str, str] | None = None
) -> tuple[pa.Array, np.ndarray]:
    """(sorted values, uint64 row ids) from `{generation_uri}/_pk_index/page_data.lance`.

    Raises NotFoundError when the generation has no primary-key index.
    """
    path = f"{generation_uri.rstrip('/')}/{PK_INDEX_DIR}/{PAGE_DATA_FILE}"
    try:
        table = LanceFileReader(path, storage_options=storage_options).read_all().to_table()
    except ValueError as e:  # Lance reports a missing object as ValueError("Not found: ...")
        if str(e).startswith("Not found"):
            raise NotFoundError(f"no primary-key index at {path}") from e
        raise
    values = table.column("values").combine_chunks()
    ids = table.column("ids").combine_chunks().to_numpy().astype(np.uint64, copy=False)
    return values, ids


# --------------------------------------------------------------------------------------------------
# Lookup
# --------------------------------------------------------------------------------------------------


def lookup(values: pa.Array, ids: np.ndarray, keys: pa.Array) -> np.ndarray:
    """Row id (int64) of the newest row (largest id) per requested key, -1 when absent or null.

    `values`/`ids` as from `read_pk_index`: sorted by value, ties by id, so a key's newest row is
    the last of its run. Keys are cast to the index's type (composite keys: `pk_index_key` first).
    """
    values = _as_array(values)
    keys = _as_array(keys)
    if keys.type != values.type:
        keys = keys.cast(values.type)
    ids = np.asarray(ids).astype(np.int64, copy=False)
    result = np.full(len(keys), -1, dtype=np.int64)
    if len(values) == 0 or len(keys) == 0:
        return result
    skip = values.null_count  # nulls sort first and never match
    values = values.slice(skip)
    ids = ids[skip:]
    key_valid = _valid_mask(keys)
    if len(values) == 0:
        return result
    if _is_fixed_width(values.type):
        vals = values.to_numpy(zero_copy_only=False)
        probe = pc.fill_null(keys, values[0]).to_numpy(zero_copy_only=False)
        pos = np.searchsorted(vals, probe, side="right") - 1
        found = key_valid & (pos >= 0)
        found[found] = vals[pos[found]] == probe[found]
        result[found] = ids[pos[found]]
        return result
    # Var-width: hash lookup of the run's first row, then jump to the run's last row.
    first = pc.index_in(keys, value_set=values)
    found = np.asarray(first.is_valid().to_numpy(zero_copy_only=False), dtype=bool) & key_valid
    first_np = pc.fill_null(first, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    run_ends = np.flatnonzero(
        np.append(np.asarray(pc.not_equal(values[1:], values[:-1]).to_numpy(zero_copy_only=False)), True)
    )
    last = run_ends[np.searchsorted(run_ends, first_np[found])]
    result[found] = ids[last]
    return result
