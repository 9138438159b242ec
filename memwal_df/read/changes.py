"""The change feed of a MemWAL table: the changes of every flushed generation, in order per region.

Where changes come from: flushed generations only (durable and immutable; the WAL of an active
MemTable is not read, as a durable reader does not read it). A generation holds the newest row of
each key of one MemTable in write order, so the feed is the net change of each flush: per key the
last upsert or delete of that MemTable. Applying the changes of each region in (`_generation`,
`_position`) order to a copy of the table makes it equal to the table (regions hold disjoint keys,
so regions may be applied in any interleaving). Generations merged into the base stay readable
until garbage collection removes them. Rows written into the base table directly (the initial data
of `create_table`) are not changes.

Each change is a row of the table's columns (a delete: its key, other columns as its tombstone row
stores them, NULL) plus `_change_type` (`upsert` / `delete`), `_region` (the region id), `_generation`
and `_position` (its row index in the generation's scan order). Offsets: `ChangeOffsets`
(`memwal_df.format.consumers`).

Guarantees: a read from offsets `O` yields every change `c` of region `r` with `O(r) <= (generation,
position) of c < E(r)` exactly once, in that order per region, where `E` (`ChangeFeed.end`) is fixed
when the read is planned, from each region's latest manifest; a later read from `E` continues with
nothing skipped or repeated. Generation numbers of a region are consecutive from 1 (a writer flushes
its region's `current_generation` and the manifest then names the next one), and GC removes a
region's lowest generations: so an offset below the region's lowest listed generation needs changes
GC removed and raises `ChangesExpiredError` (also when GC removes a generation while it is read).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import ChangesExpiredError, InvalidArgumentError, MissingGenerationError
from memwal_df.format import layout
from memwal_df.format.checksums import verify_generation_once
from memwal_df.format.consumers import (
    DEFAULT_EXPIRY,
    ChangeOffsets,
    Consumer,
    Position,
    check_expiry,
    clear_expired,
    commit_offsets,
    expired,
    read_consumer,
)
from memwal_df.format.manifest import RegionManifestStore, read_regions
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.rows import TOMBSTONE
from memwal_df.format.storage import Storage
from memwal_df.format.table_handle import TableHandle
from memwal_df.read.lsm.keys import last_per_key

CHANGE_TYPE, REGION, GENERATION, POSITION = "_change_type", "_region", "_generation", "_position"
CHANGE_COLUMNS = (CHANGE_TYPE, REGION, GENERATION, POSITION)
UPSERT, DELETE = "upsert", "delete"
EARLIEST, LATEST = "earliest", "latest"
Since = ChangeOffsets | Mapping[str, Any] | str
"""Where a read starts: offsets (`ChangeOffsets`, their dict or JSON form), `"earliest"` (each
region's oldest retained change) or `"latest"` (after each region's newest flushed change)."""


def feed_columns(schema: pa.Schema, primary_key: Sequence[str], columns: Sequence[str] | None) -> list[str]:
    """The table columns a read returns: `columns` (all when None) plus the primary key, in table
    order; `InvalidArgumentError` for a name the table lacks."""
    if columns is None:
        return list(schema.names)
    unknown = sorted(set(columns) - set(schema.names))
    if unknown:
        raise InvalidArgumentError(f"the table has no columns {unknown}")
    wanted = set(columns) | set(primary_key)
    return [n for n in schema.names if n in wanted]


def table_columns(schema: pa.Schema) -> list[str]:
    """The table columns of a `change_schema`."""
    return schema.names[: -len(CHANGE_COLUMNS)]


def change_schema(schema: pa.Schema, columns: Sequence[str] | None = None) -> pa.Schema:
    """The feed's schema: the table's `columns` (all when None) then the four change columns."""
    names = schema.names if columns is None else columns
    return pa.schema(
        [
            *(schema.field(n).remove_metadata() for n in names),
            pa.field(CHANGE_TYPE, pa.string(), nullable=False),
            pa.field(REGION, pa.string(), nullable=False),
            pa.field(GENERATION, pa.int64(), nullable=False),
            pa.field(POSITION, pa.int64(), nullable=False),
        ]
    )


def net_changes(changes: pa.Table, primary_key: Sequence[str]) -> tuple[pa.Table, pa.Table]:
    """What applying `changes` (feed rows, in any order) to a copy of the table comes to: the rows to
    upsert (the table columns) and the keys to delete, from each key's last change in
    (`_generation`, `_position`) order (a key's changes are all in its region)."""
    ordered = changes.sort_by([(GENERATION, "ascending"), (POSITION, "ascending")])
    last = last_per_key(ordered, primary_key)
    deleted = pc.equal(last.column(CHANGE_TYPE), DELETE)
    columns = [n for n in last.column_names if n not in CHANGE_COLUMNS]
    return last.filter(pc.invert(deleted)).select(columns), last.filter(deleted).select(list(primary_key))


# ------------------------------------------------------------------------------ what regions offer


@dataclass(frozen=True)
class RegionChanges:
    """A region's flushed generations ((number, directory relative to the table root), ascending)
    and the number its next flush gets, from one manifest."""

    region_id: uuid.UUID
    generations: tuple[tuple[int, str], ...]
    next_generation: int

    @property
    def first_retained(self) -> int:
        """The oldest generation still held (the next one when none is)."""
        return self.generations[0][0] if self.generations else self.next_generation


def _region_changes(region_id: uuid.UUID, m: pb.ShardManifest) -> RegionChanges:
    gens = tuple(sorted((s.generation, layout.generation_path(region_id, s.path)) for s in m.sstables))
    return RegionChanges(region_id, gens, max(m.current_generation, gens[-1][0] + 1 if gens else 1))


def region_changes(table: TableHandle) -> dict[uuid.UUID, RegionChanges]:
    """Every region's changes as its latest manifest lists them (a manifest that cannot be decoded
    raises `CorruptManifestError`: the feed never skips a region)."""
    ids = table.region_ids()
    storage = table.storage

    def latest(region_id: uuid.UUID) -> pb.ShardManifest | None:
        return RegionManifestStore(storage, region_id).latest()

    manifests = read_regions(storage, ids, latest)
    return {r: _region_changes(r, m) for r, m in zip(ids, manifests, strict=True) if m is not None}


# ------------------------------------------------------------------------------ offsets


def resolve(since: Since, regions: Mapping[uuid.UUID, RegionChanges]) -> ChangeOffsets:
    """`since` as offsets naming every region of `regions` (regions that given offsets do not name
    start at their first change)."""
    if since == EARLIEST:
        return ChangeOffsets({r: (s.first_retained, 0) for r, s in regions.items()})
    if since == LATEST:
        return ChangeOffsets({r: (s.next_generation, 0) for r, s in regions.items()})
    if isinstance(since, str) and not since.lstrip().startswith("{"):
        raise InvalidArgumentError(f'since must be "earliest", "latest" or change offsets, got {since!r}')
    given = ChangeOffsets.parse(since)
    return ChangeOffsets({**{r: given.of(r) for r in regions}, **given.regions})


def check_retained(start: ChangeOffsets, regions: Mapping[uuid.UUID, RegionChanges]) -> None:
    """`ChangesExpiredError` if `start` needs a change of a generation GC removed."""
    for r in sorted(regions):
        first = regions[r].first_retained
        offset = start.of(r)
        if offset[0] < first:
            raise ChangesExpiredError(
                f"the changes of region {r} from generation {offset[0]} position {offset[1]} were "
                f"garbage-collected: its oldest retained generation is {first}; read from "
                '"earliest" to continue with a gap, or register consumers so GC keeps their changes',
                r,
                offset,
                first,
            )


def end_offsets(
    start: ChangeOffsets,
    regions: Mapping[uuid.UUID, RegionChanges],
    until: ChangeOffsets | None = None,
    max_generations: int | None = None,
) -> ChangeOffsets:
    """Where a read from `start` ends: after each region's newest flushed change, or at `until`
    (regions it does not name: nothing), at most `max_generations` generations in all (taken in
    generation order across regions, at least one); never before `start`."""
    end = {r: (s.next_generation, 0) for r, s in regions.items()}
    if until is not None:
        end = {r: min(e, until.regions.get(r, start.of(r))) for r, e in end.items()}
    if max_generations is not None:
        end = _limited(start, end, regions, max_generations)
    merged = {**start.regions, **end}
    return ChangeOffsets({r: max(start.of(r), e) for r, e in merged.items()})


def _limited(
    start: ChangeOffsets,
    end: dict[uuid.UUID, Position],
    regions: Mapping[uuid.UUID, RegionChanges],
    max_generations: int,
) -> dict[uuid.UUID, Position]:
    """`end` cut after the first `max_generations` generations to read, lowest numbers first."""
    if max_generations < 1:
        raise InvalidArgumentError(f"max_generations must be >= 1, got {max_generations}")
    todo = sorted(
        (g, str(r), r)
        for r, s in regions.items()
        for g, _ in s.generations
        if g >= start.of(r)[0] and (g, 0) < end[r]
    )
    cut = dict(end)
    for r in {r for _, _, r in todo}:
        cut[r] = start.of(r)  # nothing of a region none of whose generations is taken
    for g, _, r in todo[:max_generations]:
        cut[r] = min(end[r], (g + 1, 0))
    return cut


# ------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class RegionRange:
    """The changes of one region from `start` (included) to `end` (excluded) and the generations
    ((number, directory), ascending) that hold them."""

    region_id: uuid.UUID
    start: Position
    end: Position
    generations: tuple[tuple[int, str], ...]


def plan(
    start: ChangeOffsets, end: ChangeOffsets, regions: Mapping[uuid.UUID, RegionChanges]
) -> list[RegionRange]:
    """One range per region with changes between `start` and `end`, by region id."""
    ranges = []
    for r in sorted(regions):
        s, e = start.of(r), end.of(r)
        gens = tuple((g, path) for g, path in regions[r].generations if g >= s[0] and (g, 0) < e)
        if gens:
            ranges.append(RegionRange(r, s, e, gens))
    return ranges


def read_range(
    storage: Storage, rng: RegionRange, schema: pa.Schema
) -> Iterator[tuple[pa.RecordBatch, Position]]:
    """The changes of `rng` as batches of `schema` (`change_schema`), each with the offset after
    it; the last batch of a generation read to its end carries (next generation, 0)."""
    for g, path in rng.generations:
        lo = rng.start[1] if g == rng.start[0] else 0
        hi = rng.end[1] if g == rng.end[0] else None
        yield from _generation(storage, rng.region_id, g, path, lo, hi, schema)


def _generation(
    storage: Storage, region_id: uuid.UUID, g: int, path: str, lo: int, hi: int | None, schema: pa.Schema
) -> Iterator[tuple[pa.RecordBatch, Position]]:
    """Rows `lo` to `hi` (None: the end) of generation `g` as changes; one batch held back, so the
    offset after the generation's last batch can say the generation was read whole."""
    held: tuple[pa.RecordBatch, Position] | None = None
    seen = 0
    for batch in _scan(storage, region_id, g, path, table_columns(schema)):
        first, seen = seen, seen + batch.num_rows
        a, z = max(lo, first), seen if hi is None else min(hi, seen)
        if z > a:
            if held is not None:
                yield held
            held = (_changes(batch.slice(a - first, z - a), region_id, g, a, schema), (g, z))
        if hi is not None and seen >= hi:
            break
    if held is not None:
        yield held[0], (held[1] if hi is not None else (g + 1, 0))


def _scan(
    storage: Storage, region_id: uuid.UUID, g: int, path: str, columns: list[str]
) -> Iterator[pa.RecordBatch]:
    """The generation's rows (`columns` and `_tombstone`) in scan order, its files verified;
    `ChangesExpiredError` if it is gone (collected), `CorruptGenerationError` if a file does not
    match its checksum, `MissingGenerationError` if it exists but cannot be read."""
    try:
        verify_generation_once(storage, region_id, g, path)  # (gone: Lance's open below says so)
        ds = lance.dataset(storage.child_uri(path), storage_options=storage.storage_options or None)
        yield from ds.to_batches(columns=[*columns, TOMBSTONE])
    except (ValueError, OSError) as e:
        name = f"generation {g} of region {region_id}"
        if storage.list(path) or _listed(storage, region_id, g):  # damaged, not collected
            raise MissingGenerationError(f"{name} cannot be read: {path} ({e})") from e
        raise ChangesExpiredError(
            f"{name} was garbage-collected while the change feed read it", region_id, (g, 0)
        ) from e


def _listed(storage: Storage, region_id: uuid.UUID, g: int) -> bool:
    """Whether the region's latest manifest lists generation `g` (GC unlists before it deletes)."""
    m = RegionManifestStore(storage, region_id).latest()
    return m is not None and any(s.generation == g for s in m.sstables)


def _changes(
    rows: pa.RecordBatch, region_id: uuid.UUID, g: int, first: int, schema: pa.Schema
) -> pa.RecordBatch:
    """Generation rows (first at position `first`) as change rows of `schema`."""
    n = rows.num_rows
    kind = pc.if_else(rows.column(TOMBSTONE), DELETE, UPSERT)
    change = [
        kind,
        pa.repeat(str(region_id), n),
        pa.array(np.full(n, g, dtype=np.int64)),
        pa.array(np.arange(first, first + n, dtype=np.int64)),
    ]
    columns = [rows.column(name) for name in table_columns(schema)]
    return pa.RecordBatch.from_arrays([*columns, *change], schema=schema)


class ChangeFeed:
    """The changes from `start` to `end`, read lazily, once: iterating yields Arrow record batches
    of `schema` (`change_schema`); `offsets` is where the batches yielded so far end (`end` once
    all were), to resume from. With a `consumer`, `commit()` records `offsets` as its offsets."""

    def __init__(
        self,
        storage: Storage,
        ranges: list[RegionRange],
        start: ChangeOffsets,
        end: ChangeOffsets,
        schema: pa.Schema,
        consumer: str | None = None,
    ) -> None:
        self.storage, self.ranges, self.start, self.end, self.schema = storage, ranges, start, end, schema
        self.consumer = consumer
        self._at = dict(start.regions)
        self._batches = self._read()

    def _read(self) -> Iterator[pa.RecordBatch]:
        for rng in self.ranges:
            for batch, after in read_range(self.storage, rng, self.schema):
                self._at[rng.region_id] = after
                yield batch
        self._at = dict(self.end.regions)

    def __iter__(self) -> ChangeFeed:
        return self

    def __next__(self) -> pa.RecordBatch:
        return next(self._batches)

    @property
    def offsets(self) -> ChangeOffsets:
        """Where the batches yielded so far end (`end` once all were): the `since` to resume from."""
        return ChangeOffsets(dict(self._at))

    def read_all(self) -> pa.Table:
        """Every change not yet iterated, as one table."""
        return pa.Table.from_batches(list(self), schema=self.schema)

    def commit(self) -> Consumer:
        """Record `offsets` as the consumer's (`InvalidArgumentError` without a consumer)."""
        if self.consumer is None:
            raise InvalidArgumentError("commit() needs a feed opened with consumer=...")
        return commit_offsets(self.storage, self.consumer, self.offsets)


def open_feed(
    table: TableHandle,
    since: Since | None = None,
    *,
    until: Since | None = None,
    consumer: str | None = None,
    max_generations: int | None = None,
    columns: Sequence[str] | None = None,
) -> ChangeFeed:
    """The feed from `since` (None: the consumer's committed offsets, else "earliest") to `until`
    (None or "latest": every flushed change); a `consumer` not registered yet is registered at the
    start (so GC keeps its changes from now on). `ChangesExpiredError` if GC removed changes the
    start needs."""
    regions = region_changes(table)
    known = None if consumer is None else read_consumer(table.storage, consumer)
    if since is None and consumer is not None and known is None and expired(table.storage, consumer):
        raise ChangesExpiredError(
            f"the record of consumer {consumer!r} was removed by GC: it had not committed offsets for "
            "longer than its expiry plus the record retention, and changes it had not read may be gone; "
            'open the feed with since= ("earliest" or offsets) to register it again, or remove it'
        )
    if since is None:
        since = EARLIEST if known is None else known.offsets
    start = resolve(since, regions)
    check_retained(start, regions)
    if consumer is not None and known is None:
        commit_offsets(table.storage, consumer, start)
        clear_expired(table.storage, consumer)
    stop = None if until is None or until == LATEST else ChangeOffsets.parse(until)
    end = end_offsets(start, regions, stop, max_generations)
    names = feed_columns(table.schema.schema, table.schema.primary_key, columns)
    return ChangeFeed(
        table.storage,
        plan(start, end, regions),
        start,
        end,
        change_schema(table.schema.schema, names),
        consumer,
    )


def register_consumer(
    table: TableHandle, consumer_id: str, since: Since = EARLIEST, expiry: timedelta = DEFAULT_EXPIRY
) -> Consumer:
    """Register `consumer_id` at `since` (GC keeps its changes from then on while it commits at
    least every `expiry`); an already registered consumer is returned unchanged."""
    check_expiry(expiry)
    known = read_consumer(table.storage, consumer_id)
    if known is not None:
        return known
    regions = region_changes(table)
    start = resolve(since, regions)
    check_retained(start, regions)
    registered = commit_offsets(table.storage, consumer_id, start, expiry)
    clear_expired(table.storage, consumer_id)
    return registered
