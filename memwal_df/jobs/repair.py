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

Corrupt flushed generations are repaired by `memwal_df.jobs.generation_repair` (which `Table.repair_region`
runs after this module's WAL plan); their fixes (`GenerationFix`) are part of the same `RepairPlan`.

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
    CorruptGenerationError,
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
_CORRUPT = (CorruptManifestError, CorruptWalEntryError, CorruptGenerationError)
T = TypeVar("T")


def each_region(
    fn: Callable[[uuid.UUID], T],
    ids: Sequence[uuid.UUID],
    mapper: Callable[[Callable[[uuid.UUID], object], Sequence[uuid.UUID]], Iterable[object]] = map,
) -> tuple[list[T], dict[uuid.UUID, CorruptManifestError | CorruptWalEntryError | CorruptGenerationError]]:
    """`fn` of each region (through `mapper`, e.g. a pool's `map`), in order, and the errors of the
    regions whose own manifest, WAL entry or flushed generation is corrupt (skipped; every other
    error propagates, a corrupt file outside the region's directory too, such as a table-wide lease)."""

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
class GenerationFix:
    """One corrupt unmerged generation a repair rebuilds from the WAL entries holding its rows
    (`wal_positions`, first and last, when all are stored and readable) or, failing that, drops from
    the region manifest (`why_not` says why; its `rows`, as its manifest entry counts them, are
    lost). Its corrupt directory is moved to the quarantine directory either way."""

    generation: int
    path: str  # its directory, relative to the table root
    error: str  # why it is corrupt
    rows: int  # physical rows its region manifest entry lists (0: not recorded)
    wal_positions: tuple[int, int] | None  # None: it cannot be rebuilt
    why_not: str | None  # why it cannot be rebuilt (None when it can)
    rebuilt_rows: int | None = None  # keys the WAL entries replay to
    # whether those account for `rows` (False: it held writes no WAL entry holds, which are lost)
    complete: bool = True
    rebuilt_path: str | None = None  # the rebuilt generation's directory, once applied

    @property
    def rebuild(self) -> bool:
        return self.wal_positions is not None

    def describe(self, applied: bool, quarantine: str) -> str:
        head = f"  generation {self.generation} ({self.path}): {self.error}\n"
        quarantine = f"{quarantine}/{self.path.rsplit('/', 1)[1]}"
        if self.wal_positions is not None:
            first, last = self.wal_positions
            verb = "rebuilt" if applied else "would rebuild it"
            where = f" as {self.rebuilt_path}" if self.rebuilt_path else ""
            text = f"    {verb} from WAL entries {first}-{last}{where} ({self.rebuilt_rows} rows)"
            if not self.complete:
                text += (
                    f"; its manifest entry lists {self.rows} rows: the writes no WAL entry holds (a "
                    "non-durable writer's last writes before its flush) are lost"
                )
            return head + text + f"; its directory moves to {quarantine}"
        verb = "set aside" if applied else "would set it aside"
        rows = f"its {self.rows} row(s)" if self.rows else "its rows"
        return head + (
            f"    cannot rebuild it ({self.why_not}): {verb} as {quarantine}, dropped from the region "
            f"manifest; {rows} are lost (readers see each key's next older version)"
        )


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
    generations: tuple[GenerationFix, ...] = ()  # corrupt unmerged generations
    generation_quarantine: str | None = None  # where their corrupt files go (are)

    @property
    def rows_lost(self) -> int:
        """Rows of the valid entries and of the generations set aside (those of corrupt entries
        cannot be counted)."""
        return sum(e.rows or 0 for e in self.entries) + sum(g.rows for g in self.generations if not g.rebuild)

    def describe(self) -> str:
        """What will be (was) lost, in words an operator can check before confirming."""
        text = self._describe_wal()
        if not self.generations:
            return text
        n = len(self.generations)
        lines = [f"region {self.region_id}: {n} corrupt generation{'s' if n > 1 else ''}:"]
        assert self.generation_quarantine is not None
        lines += [g.describe(self.applied, self.generation_quarantine) for g in self.generations]
        if not (self.entries or self.covered):
            return "\n".join(lines)
        return text + "\n" + "\n".join(lines)

    def _describe_wal(self) -> str:
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


def generation_quarantine(region_id: uuid.UUID) -> str:
    """Where a repair moves the region's corrupt generation directories (each under its own name)."""
    return f"{layout.region_dir(region_id)}/{QUARANTINE_DIR}/generations"


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
        move(storage, e.path, f"{quarantine}/{e.path.rsplit('/', 1)[1]}")
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


def move(storage: Storage, path: str, to: str) -> None:
    """Copy `path` to `to`, then delete `path` (a file already moved is skipped)."""
    try:
        data = storage.get(path)
    except NotFoundError:
        return
    storage.put(to, data)
    storage.delete(path)
