"""Lance deletion files: which physical rows of a fragment a version deletes, read from the file.

Lance 14 writes a fragment's deletion vector as `_deletions/{fragment}-{read_version}-{id}.arrow`
(type `array`: an Arrow IPC file of one `uint32` column of offsets) or `.bin` (type `bitmap`: a 32-bit
Roaring bitmap in the portable serialization, the format of `RoaringBitmap::serialize_into`). A
deletion file never changes once written: a newer deletion of the fragment writes a new file, which
holds every offset of the old one. Reading it costs in proportion to the deletions, where a Lance scan
of the fragment's live row addresses costs in proportion to its rows.

Guarantees: `deleted_offsets` returns exactly the offsets Lance removes (a decoded file must hold as
many offsets as the manifest records), else Lance's own scan of the fragment's live rows decides;
`decode` raises `ValueError` for bytes that are not such a file.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from memwal_df.format.storage import Storage

__all__ = ["decode", "deleted_offsets", "deletion_file_id", "roaring_values"]

_COOKIE_NO_RUNS = 12346
_COOKIE_RUNS = 12347
_NO_OFFSET_THRESHOLD = 4
_ARRAY_MAX = 4096


def deletion_file_id(fragment: Any) -> str:
    """What identifies the fragment's deletion vector: `-` without one, else its file's id."""
    d = fragment.metadata.deletion_file
    return "-" if d is None else f"{d.read_version}-{d.id}"


def deleted_offsets(storage: Storage | None, fragment: Any) -> np.ndarray:
    """The sorted physical offsets (int64) the fragment's deletion vector removes; `storage` is the
    dataset's (paths relative to its root), None to ask Lance."""
    d = fragment.metadata.deletion_file
    if d is None:
        return np.zeros(0, np.int64)
    path = fragment.deletion_file()
    if storage is not None and d.base_id is None and path is not None:
        try:
            offsets = decode(storage.get(path), d.file_type).astype(np.int64)
        except (OSError, ValueError):  # StorageError, ArrowInvalid, a corrupt bitmap: Lance decides
            offsets = None
        if offsets is not None and (d.num_deleted_rows is None or len(offsets) == d.num_deleted_rows):
            return offsets
    return _scanned(fragment)


def _scanned(fragment: Any) -> np.ndarray:
    """The deleted offsets from Lance's scan of the fragment's live row addresses."""
    live = fragment.scanner(columns=[], with_row_address=True).to_table().column("_rowaddr")
    kept = np.zeros(fragment.metadata.physical_rows, dtype=bool)
    kept[(live.to_numpy() & np.uint64(0xFFFFFFFF)).astype(np.int64)] = True
    return np.flatnonzero(~kept)


def decode(data: bytes, file_type: str) -> np.ndarray:
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
