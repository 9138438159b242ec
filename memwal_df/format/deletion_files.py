"""Deletion files of a Lance fragment: the physical row offsets its deletion vector removes.

Lance 14 writes a fragment's deletion vector as `_deletions/{fragment}-{read_version}-{id}.arrow`
(type `array`: an Arrow IPC file of one `uint32` column of offsets) or `.bin` (type `bitmap`: a
roaring bitmap in the portable serialization). A deletion file never changes once written: a newer
deletion of the fragment writes a new file, which holds every offset of the old one.

Guarantees: `deleted_offsets` returns exactly the offsets Lance removes (checked against the count the
manifest records), else falls back to Lance's own scan of the fragment's live rows.
"""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyroaring

from memwal_df.format.storage import Storage

__all__ = ["deleted_offsets", "deletion_file_id"]


def deletion_file_id(fragment: lance.LanceFragment) -> str:
    """What identifies the fragment's deletion vector: `-` without one, else its file's id."""
    d = fragment.metadata.deletion_file
    return "-" if d is None else f"{d.read_version}-{d.id}"


def deleted_offsets(storage: Storage, fragment: lance.LanceFragment) -> np.ndarray:
    """The sorted physical offsets (int64) the fragment's deletion vector removes; `storage` is the
    dataset's (paths relative to its root)."""
    d = fragment.metadata.deletion_file
    if d is None:
        return np.zeros(0, np.int64)
    path = fragment.deletion_file()
    if d.base_id is None and path is not None:
        try:
            offsets = _decode(d.file_type, storage.get(path))
        except (OSError, ValueError):  # StorageError, ArrowInvalid, a corrupt bitmap: Lance decides
            offsets = None
        if offsets is not None and (d.num_deleted_rows is None or len(offsets) == d.num_deleted_rows):
            return offsets
    return _scanned(fragment)


def _decode(file_type: str, data: bytes) -> np.ndarray | None:
    if file_type == "bitmap":
        offsets = np.asarray(pyroaring.BitMap.deserialize(data).to_array(), dtype=np.int64)
    elif file_type == "array":
        table = ipc.open_file(pa.BufferReader(data)).read_all()
        offsets = np.sort(table.column(0).to_numpy().astype(np.int64))
    else:
        return None
    return offsets


def _scanned(fragment: lance.LanceFragment) -> np.ndarray:
    """The deleted offsets from Lance's scan of the fragment's live row addresses."""
    live = fragment.scanner(columns=[], with_row_address=True).to_table().column("_rowaddr")
    kept = np.zeros(fragment.metadata.physical_rows, dtype=bool)
    kept[(live.to_numpy() & np.uint64(0xFFFFFFFF)).astype(np.int64)] = True
    return np.flatnonzero(~kept)
