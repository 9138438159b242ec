"""Lance deletion files: which physical rows of a fragment a version deletes, read from the file.

A fragment's deletion file (`_deletions/<fragment>-<read version>-<id>.<ext>` under the dataset) holds
the offsets of its deleted rows: `array` files (`.arrow`) as an Arrow IPC file of one uint32 column,
`bitmap` files (`.bin`) as a 32-bit Roaring bitmap in the portable serialization (the format of
`RoaringBitmap::serialize_into`). Reading it costs in proportion to the deletions, where a Lance scan
of the fragment's live row addresses costs in proportion to its rows.

Guarantees: `deleted_offsets` returns the sorted offsets the file holds, or raises `ValueError` for
bytes that are not such a file (callers then ask Lance).
"""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

__all__ = ["deleted_offsets", "roaring_values"]

_COOKIE_NO_RUNS = 12346
_COOKIE_RUNS = 12347
_NO_OFFSET_THRESHOLD = 4
_ARRAY_MAX = 4096


def deleted_offsets(data: bytes, file_type: str) -> np.ndarray:
    """The sorted row offsets (uint32) a deletion file of `file_type` (`array` or `bitmap`) holds."""
    if file_type == "array":
        try:
            table = ipc.open_file(pa.py_buffer(data)).read_all()
        except pa.ArrowInvalid as e:
            raise ValueError(f"not an Arrow deletion file: {e}") from e
        if table.num_columns != 1 or not pa.types.is_integer(table.schema.field(0).type):
            raise ValueError(f"unexpected deletion file schema {table.schema}")
        return np.sort(table.column(0).to_numpy().astype(np.uint32))
    if file_type == "bitmap":
        return roaring_values(data)
    raise ValueError(f"unknown deletion file type {file_type!r}")


def roaring_values(data: bytes) -> np.ndarray:
    """The sorted values (uint32) of a Roaring bitmap in the portable serialization."""
    try:
        return _roaring(data)
    except (struct.error, IndexError) as e:
        raise ValueError(f"truncated Roaring bitmap: {e}") from e


def _roaring(data: bytes) -> np.ndarray:
    (cookie,) = struct.unpack_from("<I", data, 0)
    if cookie == _COOKIE_NO_RUNS:
        (n,) = struct.unpack_from("<I", data, 4)
        pos, runs = 8, np.zeros(n, dtype=bool)
    elif cookie & 0xFFFF == _COOKIE_RUNS:
        n = (cookie >> 16) + 1
        size = (n + 7) // 8
        flags = np.frombuffer(data, np.uint8, size, 4)
        runs = np.unpackbits(flags, bitorder="little")[:n].astype(bool)
        pos = 4 + size
    else:
        raise ValueError(f"not a Roaring bitmap (cookie {cookie})")
    header = np.frombuffer(data, "<u2", 2 * n, pos).astype(np.int64)
    keys, cards = header[0::2], header[1::2] + 1
    pos += 4 * n
    if cookie == _COOKIE_NO_RUNS or n >= _NO_OFFSET_THRESHOLD:
        pos += 4 * n  # container offsets: the containers follow in order anyway
    parts = []
    for i in range(n):
        if runs[i]:
            (count,) = struct.unpack_from("<H", data, pos)
            pairs = np.frombuffer(data, "<u2", 2 * count, pos + 2).astype(np.int64)
            pos += 2 + 4 * count
            starts, lengths = pairs[0::2], pairs[1::2] + 1
            values = np.repeat(starts - np.cumsum(np.r_[0, lengths[:-1]]), lengths) + np.arange(lengths.sum())
        elif cards[i] > _ARRAY_MAX:
            words = np.frombuffer(data, np.uint8, 8192, pos)
            pos += 8192
            values = np.flatnonzero(np.unpackbits(words, bitorder="little"))
        else:
            values = np.frombuffer(data, "<u2", int(cards[i]), pos).astype(np.int64)
            pos += 2 * int(cards[i])
        parts.append((keys[i] << 16) | values)
    if pos > len(data):
        raise ValueError("truncated Roaring bitmap")
    out = np.concatenate(parts) if parts else np.empty(0, np.int64)
    return out.astype(np.uint32)
