"""Flushed generations: a sealed MemTable written as a Lance table at `_mem_wal/{region}/{hex8}_gen_{g}/`.

The table has the base schema plus `_tombstone: bool not null`, one fragment, the base table's data
storage version and V2 manifest naming. Beside it: `bloom_filter.bin` (every key of the MemTable) and
`_pk_index/` (the primary-key sidecar Lance's readers use). memwal_df writes only the newest row of
each key (tombstones included), in forward write order, so a generation never needs a deletion
vector; Lance writes every row and hides older duplicates with one — both read the same.

Guarantees: `write_generation` either returns the `SsTable` entry of a complete directory or raises;
a directory it leaves behind after a failure is never referenced by a manifest (the caller retries in
a new directory with a new random prefix).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence

import lance
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df import layout
from memwal_df._proto import memwal_pb2 as pb
from memwal_df.errors import MissingGenerationError
from memwal_df.memtable import MemTable
from memwal_df.pk_index import write_pk_index
from memwal_df.storage import Storage

# Lance writes generations with usize::MAX rows per file: one fragment whatever the size.
_ONE_FRAGMENT = 1 << 62


def primary_key_bytes(table: pa.Table, primary_key: Sequence[str]) -> int:
    """Lance's `primary_key_bytes` statistic: width × rows for fixed-width key columns,
    Σ len(value) + 4 × rows for strings and binaries."""
    total = 0
    for name in primary_key:
        col = table.column(name)
        t = col.type
        if (
            pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)
        ):
            lengths = pc.binary_length(col)
            total += int(pc.sum(lengths).as_py() or 0) + 4 * len(col)
        else:
            total += (t.bit_width // 8) * len(col)
    return total


def write_generation(
    storage: Storage,
    region_id: uuid.UUID,
    memtable: MemTable,
    data_storage_version: str,
) -> pb.SsTable:
    """Write `memtable` as a new generation directory and return its manifest entry."""
    data = memtable.newest()
    dir_name = layout.generation_dir_name(secrets.token_hex(4), memtable.generation)
    rel = layout.generation_path(region_id, dir_name)
    uri = storage.child_uri(rel)
    lance.write_dataset(
        data,
        uri,
        mode="create",
        data_storage_version=data_storage_version,
        max_rows_per_file=_ONE_FRAGMENT,
        storage_options=storage.storage_options or None,
    )
    storage.put(f"{rel}/{layout.BLOOM_FILTER_FILE}", memtable.bloom.to_bytes())
    write_pk_index(uri, [data.column(c) for c in memtable.primary_key], storage.storage_options or None)
    return pb.SsTable(
        generation=memtable.generation,
        path=dir_name,
        in_memory_bytes=memtable.nbytes,
        physical_rows=data.num_rows,
        primary_key_bytes=primary_key_bytes(data, memtable.primary_key),
    )


def open_generation(storage: Storage, region_id: uuid.UUID, sstable: pb.SsTable) -> lance.LanceDataset:
    """The Lance dataset of a flushed generation; MissingGenerationError if its directory is gone."""
    rel = layout.generation_path(region_id, sstable.path)
    try:
        return lance.dataset(storage.child_uri(rel), storage_options=storage.storage_options or None)
    except (ValueError, OSError) as e:
        raise MissingGenerationError(
            f"generation {sstable.generation} of region {region_id} is missing: {rel}"
        ) from e
