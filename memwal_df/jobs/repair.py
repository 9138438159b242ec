"""Finding corrupt region files, and the operator's repair: setting corrupt WAL entries aside.

`wal_problem` tells whether a region's unreplayed WAL entries (those after
`replay_after_wal_entry_position`, which a claiming writer replays) can all be decoded. `repair_region`
plans, and with `apply=True` performs, the repair of a corrupt WAL:

* A corrupt TRAILING entry (no valid entry after it) is typically a torn last write. It is moved to
  `_mem_wal/{region}/quarantine/epoch-{E}/` (never deleted), after the repair claimed the region with
  a new epoch E (fencing any writer still active), and a fence sentinel of epoch E takes its
  position, as a claiming writer would write one (spec "Writer Expectations"). The next writer then
  replays every entry before it and skips the sentinel; Lance's writers and readers do the same.
* A corrupt entry in the MIDDLE of the WAL has valid entries after it. Replay stops at the first
  missing position, so setting the corrupt entry aside alone would hide the later ones and let the
  next writer reuse their positions: the repair refuses unless `discard_later=True`, which sets the
  corrupt entry and every later one aside (their rows, counted in the plan, are lost).

A corrupt entry at a position flushed generations cover (at most `replay_after_wal_entry_position`:
replay never reads it, GC does) holds no row that is not in a generation: it is set aside with the
others, or alone, without a claim.

Guarantees: nothing is changed without `apply=True`; what is set aside is exactly the plan's
entries; a region without damage is never touched.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from memwal_df.errors import (
    CommitConflictError,
    CorruptManifestError,
    CorruptWalEntryError,
    NotFoundError,
    RepairRefusedError,
)
from memwal_df.format import layout
from memwal_df.format.manifest import RegionManifestStore, next_version
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage
from memwal_df.format.wal import Wal, encode_fence_sentinel

QUARANTINE_DIR = "quarantine"
_CORRUPT = (CorruptManifestError, CorruptWalEntryError)
T = TypeVar("T")


def each_region(
    fn: Callable[[uuid.UUID], T],
    ids: Sequence[uuid.UUID],
    mapper: Callable[[Callable[[uuid.UUID], object], Sequence[uuid.UUID]], Iterable[object]] = map,
) -> tuple[list[T], dict[uuid.UUID, CorruptManifestError | CorruptWalEntryError]]:
    """`fn` of each region (through `mapper`, e.g. a pool's `map`), in order, and the errors of the
    regions whose own manifest or WAL entry cannot be decoded (skipped; every other error propagates,
    a corrupt file outside the region's directory too, such as a table-wide lease)."""

    def guarded(region_id: uuid.UUID) -> object:
        try:
            return fn(region_id)
        except _CORRUPT as e:
            if str(region_id) not in e.path:
                raise
            return e

    done: list[T] = []
    failed = {}
    for region_id, out in zip(ids, mapper(guarded, ids), strict=True):
        if isinstance(out, _CORRUPT):
            failed[region_id] = out
        else:
            done.append(out)  # type: ignore[arg-type]
    return done, failed


@dataclass(frozen=True)
class RegionProblem:
    """A region with a file that cannot be decoded: `kind` ("manifest" or "wal") and `path` name it,
    `error` says why."""

    region_id: uuid.UUID
    kind: str
    path: str
    error: str


def manifest_problem(region_id: uuid.UUID, error: CorruptManifestError) -> RegionProblem:
    return RegionProblem(region_id, "manifest", error.path, str(error))


def wal_problem(storage: Storage, region_id: uuid.UUID, replay_after: int) -> RegionProblem | None:
    """The first WAL entry after `replay_after` (the entries a claiming writer replays) that cannot
    be decoded, or None."""
    try:
        for _ in Wal(storage, region_id).scan(replay_after + 1):  # decodes each entry
            pass
    except CorruptWalEntryError as e:
        return RegionProblem(region_id, "wal", e.path, str(e))
    return None


@dataclass(frozen=True)
class SetAside:
    """One WAL entry a repair sets aside: `error` why it is corrupt (None: a valid entry after the
    corrupt one, holding `rows` rows written by epoch `writer_epoch`)."""

    position: int
    path: str
    size: int
    error: str | None
    rows: int | None
    writer_epoch: int | None


@dataclass(frozen=True)
class RepairPlan:
    """What `repair_region` sets aside (or did, when `applied`) for one region."""

    region_id: uuid.UUID
    entries: tuple[SetAside, ...]  # unreplayed, ascending, from the first corrupt one; may be empty
    trailing: bool  # no valid entry follows the first corrupt one
    quarantine: str | None  # where the entries go (are), relative to the table root
    applied: bool
    # corrupt entries at positions flushed generations cover (replay never reads them): no row lost
    covered: tuple[SetAside, ...] = ()

    @property
    def rows_lost(self) -> int:
        """Rows of the valid entries set aside (those of corrupt entries cannot be counted)."""
        return sum(e.rows or 0 for e in self.entries)

    def describe(self) -> str:
        """What will be (was) lost, in words an operator can check before confirming."""
        moved = len(self.entries) + len(self.covered)
        if not moved:
            return f"region {self.region_id}: no corrupt WAL entry, nothing to repair"
        verb = "set aside" if self.applied else "would set aside"
        lines = [f"region {self.region_id}: {verb} {moved} WAL entr{_ies(moved)}:"]
        for e in self.covered:
            lines.append(
                f"  position {e.position} ({e.path}, {e.size} bytes): corrupt ({e.error}), but flushed "
                "generations hold its rows: nothing is lost"
            )
        for e in self.entries:
            what = (
                f"corrupt, its rows cannot be read ({e.error})"
                if e.error is not None
                else f"valid, {e.rows} row(s) of writer epoch {e.writer_epoch}"
            )
            lines.append(f"  position {e.position} ({e.path}, {e.size} bytes): {what}")
        if self.entries:
            lines.append(
                "  The rows of the entries no generation holds are lost. A durable write returned once its "
                "entry was stored, so they may have been acknowledged; a corrupt last entry is usually a "
                "write torn by a crash."
            )
        if self.rows_lost:
            lines.append(f"  {self.rows_lost} readable row(s) of valid later entries are lost too.")
        lines.append(f"  Files are moved to {self.quarantine}, not deleted.")
        return "\n".join(lines)


def _ies(n: int) -> str:
    return "y" if n == 1 else "ies"


def plan_repair(storage: Storage, region_id: uuid.UUID) -> tuple[RepairPlan, pb.ShardManifest | None]:
    """The repair plan of the region's WAL (not applied) and the manifest it was made from. Raises
    `CorruptManifestError` when the latest region manifest itself cannot be decoded."""
    try:
        m = RegionManifestStore(storage, region_id).latest()
    except CorruptManifestError as e:
        e.add_note("repair sets WAL entries aside only: restore this manifest file from a backup")
        raise
    if m is None:
        return RepairPlan(region_id, (), True, None, False), None
    wal = Wal(storage, region_id)
    covered = tuple(_covered_corrupt(storage, wal, m.replay_after_wal_entry_position))
    position, entries = m.replay_after_wal_entry_position + 1, []
    while (size := storage.head(wal.path(position))) is not None:
        try:
            entry = wal.read(position)
        except CorruptWalEntryError as e:
            entries.append(SetAside(position, wal.path(position), size, str(e), None, None))
        else:
            if entry is not None and entries:
                entries.append(
                    SetAside(position, wal.path(position), size, None, entry.num_rows, entry.writer_epoch)
                )
        position += 1
    trailing = all(e.error is not None for e in entries)
    quarantine = None
    if entries or covered:
        quarantine = _quarantine(region_id, m.writer_epoch + 1 if entries else m.writer_epoch)
    return RepairPlan(region_id, tuple(entries), trailing, quarantine, False, covered), m


def _covered_corrupt(storage: Storage, wal: Wal, replay_after: int) -> list[SetAside]:
    """The corrupt entries at positions up to `replay_after` (GC deletes these positions once their
    generations are merged, so there are few)."""
    out = []
    for position in (p for p in wal.stored_positions() if p <= replay_after):
        try:
            wal.read(position)
        except CorruptWalEntryError as e:
            size = storage.head(wal.path(position)) or 0
            out.append(SetAside(position, wal.path(position), size, str(e), None, None))
    return out


def _quarantine(region_id: uuid.UUID, epoch: int) -> str:
    return f"{layout.region_dir(region_id)}/{QUARANTINE_DIR}/epoch-{epoch}"


def repair_region(
    storage: Storage, region_id: uuid.UUID, *, apply: bool = False, discard_later: bool = False
) -> RepairPlan:
    """Plan (and with `apply=True` perform) setting the region's corrupt WAL entries aside; see the
    module docstring. Raises `RepairRefusedError` for a corrupt entry followed by valid ones unless
    `discard_later`, `CorruptManifestError` for a corrupt region manifest (not repaired here), and
    `CommitConflictError` when a writer flushed the region while the repair claimed it."""
    plan, m = plan_repair(storage, region_id)
    if not plan.trailing and not discard_later:
        raise RepairRefusedError(
            f"{plan.describe()}\nThe corrupt entry is followed by valid entries: setting it aside alone "
            "would hide them from replay (replay stops at the first missing position) and let new "
            "writes reuse their positions. Repair with discard_later=True (CLI: --discard-later) to set "
            "the corrupt entry and every later entry aside, losing the rows listed above."
        )
    if not apply or not (plan.entries or plan.covered):
        return plan
    assert m is not None and plan.quarantine is not None
    quarantine = plan.quarantine
    if plan.entries:
        epoch = _claim(RegionManifestStore(storage, region_id), m)
        quarantine = _quarantine(region_id, epoch)
    for e in reversed([*plan.covered, *plan.entries]):  # highest first: the positions left stay contiguous
        _move(storage, e.path, f"{quarantine}/{e.path.rsplit('/', 1)[1]}")
    if plan.entries:
        # Like a claiming writer: a sentinel at the first free position fences writers of older
        # epochs. If a writer of an older epoch took the position first, its entry is replayed instead.
        Wal(storage, region_id).append(plan.entries[0].position, encode_fence_sentinel(epoch))
    return replace(plan, quarantine=quarantine, applied=True)


def _claim(store: RegionManifestStore, m: pb.ShardManifest) -> int:
    """Commit a manifest of a new writer epoch (as a claiming writer does); the epoch."""
    while True:
        claim = next_version(m)
        claim.writer_epoch = m.writer_epoch + 1
        if store.commit(claim):
            return claim.writer_epoch
        latest = store.latest()
        if latest is None or latest.replay_after_wal_entry_position != m.replay_after_wal_entry_position:
            raise CommitConflictError(
                f"region {store.region_id}: a writer flushed while the repair claimed the region; "
                "run the repair again (it plans anew)"
            )
        m = latest


def _move(storage: Storage, path: str, to: str) -> None:
    """Copy `path` to `to`, then delete `path` (a file already moved is skipped)."""
    try:
        data = storage.get(path)
    except NotFoundError:
        return
    storage.put(to, data)
    storage.delete(path)
