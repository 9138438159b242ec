"""Row positions within one level, shared by the search operators.

A position is a row's index in the level's scan order: the MemTable copy's row order, or a generation's
visible-row order (`LanceDataset.to_table()` order, which `take()` follows). Values derived from a
generation's files are read once per process (`Level.cached`); a MemTable's once per query.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import MissingGenerationError
from memwal_df.read.cache import PerObjectCache
from memwal_df.read.exec.take_last import _fragment_take as fragment_take
from memwal_df.read.predicate import referenced_columns
from memwal_df.read.snapshot import Level

__all__ = ["filter_mask", "level_cached", "take_rows"]

T = TypeVar("T")
RESIDENT_BYTES = 16 << 20  # a generation's rows kept in memory for `take_rows` when they fit
_TOO_LARGE = object()  # cached for a generation whose rows do not fit
_POSITION = "__memwal_position"
_MEMTABLE_VALUES: PerObjectCache[Level, dict[str, Any]] = PerObjectCache()


def level_cached(level: Level, name: str, compute: Callable[[], T]) -> T:
    """`compute()` once per generation and process, or once per MemTable copy (None is not kept)."""
    if level.kind == "generation":
        return level.cached(name, compute)  # type: ignore[no-any-return]
    values = _MEMTABLE_VALUES.get(level, dict)
    if name not in values:
        values[name] = compute()
    return values[name]  # type: ignore[no-any-return]


def read_level(level: Level, columns: Sequence[str]) -> pa.Table:
    """The level's rows (`columns` only), in position order; MissingGenerationError if it is gone."""
    rows = level.to_table(list(columns))
    if rows is None:
        raise MissingGenerationError(f"{level.name} was garbage-collected while it was searched")
    return rows


def filter_mask(level: Level, filter: pc.Expression | None) -> np.ndarray | None:
    """Bool per position: the row matches `filter` (pyarrow semantics); None without a filter."""
    if filter is None:
        return None
    rows = read_level(level, sorted(referenced_columns(filter)))
    n = rows.num_rows
    positions = rows.append_column(_POSITION, pa.array(np.arange(n, dtype=np.int64))).filter(filter)
    mask = np.zeros(n, dtype=bool)
    mask[positions.column(_POSITION).to_numpy()] = True
    return mask


def take_rows(level: Level, positions: np.ndarray, columns: Sequence[str]) -> pa.Table:
    """The rows at `positions` (in that order), `columns` only: from memory for a MemTable and for a
    generation whose `columns` take at most `RESIDENT_BYTES` (read whole once per process: a Lance
    take per call would be most of a search's row phase), else through a Lance take."""
    indices = pa.array(np.asarray(positions, dtype=np.int64))
    if level.kind == "memtable":
        assert level.table is not None
        return level.table.select(list(columns)).take(indices)
    resident = level.cached(f"resident rows:{','.join(columns)}", lambda: _resident(level, columns))
    if resident is not _TOO_LARGE:
        return resident.take(indices)  # type: ignore[no-any-return]
    ds = level.dataset()
    if ds is None:
        raise MissingGenerationError(f"{level.name} was garbage-collected while it was searched")
    fragments = level.cached("fragment-ids", lambda: [f.fragment_id for f in ds.get_fragments()])
    if len(fragments) != 1 or len(np.unique(positions)) != len(positions):
        return ds.take(indices, columns=list(columns))
    # One fragment (every generation memwal_df writes): positions are its visible offsets, taken
    # through the fragment session the point lookups keep open (about half the cost of a take).
    order = np.argsort(positions)
    rows = fragment_take(ds, fragments[0], np.asarray(positions)[order], columns)
    return rows.take(pa.array(np.argsort(order)))


def _resident(level: Level, columns: Sequence[str]) -> Any:
    """The generation's `columns`, in position order, when they take at most RESIDENT_BYTES in
    memory; else `_TOO_LARGE`."""
    ds = level.dataset()
    if ds is None:
        raise MissingGenerationError(f"{level.name} was garbage-collected while it was searched")
    on_disk = sum(d.file_size_bytes or 0 for f in ds.get_fragments() for d in f.metadata.files)
    if on_disk > RESIDENT_BYTES:  # every column, compressed: no need to read it to know
        return _TOO_LARGE
    rows = read_level(level, columns).combine_chunks()
    return rows if rows.nbytes <= RESIDENT_BYTES else _TOO_LARGE
