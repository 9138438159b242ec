"""Health you can see: the base table's shape (fragments, deletion files, compaction debt), each base
index's segments and coverage, and the last error of each background job of the maintain loop.

`table_health(ds, details, storage)` reads manifest metadata only (the fragments and index
descriptions of the base manifest `ds` and one small JSON file), never row data, so `table.status()`
stays cheap.

Job errors: after each round the maintain loop (`memwal_df.jobs.maintain`) records, per job that
failed, the failure (when, in which round, the error type and its message on one line, how many
rounds in a row it failed) in `_mem_wal/_job_errors.json` (memwal_df's own file: Lance ignores it and
`region_ids()` skips its non-UUID name); the job's next success marks it resolved (`resolved_at`),
keeping the failure for the record. Another process (`memwal status`) reads it. Each round reads
the file (one GET) and rewrites it only when the round changes it (a round without failures and
nothing to resolve writes nothing). Recording never fails a round: a storage error is logged and
the round goes on. Two maintain loops on one table may overwrite each other's record of a round;
the next round records again. Jobs run directly (`table.merge()`, `memwal merge`) record nothing:
their caller sees the error.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace

import lance

from memwal_df.errors import NotFoundError
from memwal_df.format import layout, memwal_index
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.storage import Storage
from memwal_df.jobs import compaction, index_catchup
from memwal_df.jobs.compaction import CompactionSettings

log = logging.getLogger(__name__)

JOB_ERRORS_PATH = f"{layout.MEM_WAL_DIR}/_job_errors.json"
MAX_MESSAGE = 500  # characters of an error message kept


# -------------------------------------------------------------------------------------- job errors


@dataclass(frozen=True)
class JobError:
    """The last failure of one maintain-loop job."""

    job: str
    failed_at: float  # time.time() when the failing round recorded it
    round: int  # the maintain round it failed in
    error_type: str
    message: str  # the error message on one line, at most MAX_MESSAGE characters
    failures: int = 1  # rounds in a row the job failed, up to this failure
    resolved_at: float | None = None  # when the job next succeeded; None: still failing

    @property
    def resolved(self) -> bool:
        """Whether the job succeeded since this failure."""
        return self.resolved_at is not None


def one_line(error: BaseException) -> str:
    """`error`'s message on one line (its lines joined, runs of white space as one space), cut to
    MAX_MESSAGE characters."""
    line = " ".join(str(error).split())
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 1] + "…"


def read_job_errors(storage: Storage) -> dict[str, JobError]:
    """Job name -> its last failure; empty when none was recorded. An unreadable record (a file
    written by hand, a newer format) counts as empty: it only reports."""
    try:
        found = json.loads(storage.get(JOB_ERRORS_PATH))
    except NotFoundError:
        return {}
    except ValueError:
        log.warning("ignoring the unreadable job error record %s", JOB_ERRORS_PATH)
        return {}
    out = {}
    for job, entry in (found.get("jobs", {}) if isinstance(found, dict) else {}).items():
        try:
            out[job] = JobError(**{**entry, "job": job})
        except TypeError:
            log.warning("ignoring an unreadable entry for job %s in %s", job, JOB_ERRORS_PATH)
    return out


def updated_job_errors(
    old: Mapping[str, JobError],
    number: int,
    ran: Iterable[str],
    errors: Mapping[str, BaseException],
    now: float,
) -> dict[str, JobError]:
    """The record after round `number` ran the jobs `ran` and `errors` failed (a job in both failed)."""
    new = dict(old)
    for job, error in errors.items():
        prev = old.get(job)
        streak = prev.failures + 1 if prev is not None and not prev.resolved else 1
        new[job] = JobError(job, now, number, type(error).__name__, one_line(error), streak)
    for job in set(ran) - set(errors):
        prev = old.get(job)
        if prev is not None and not prev.resolved:
            new[job] = replace(prev, resolved_at=now)
    return new


def record_round(
    storage: Storage, number: int, ran: Iterable[str], errors: Mapping[str, BaseException]
) -> dict[str, JobError] | None:
    """Record round `number`'s failures and resolve the jobs that succeeded; the new record, or None
    when nothing was written (nothing changed, or the write failed: logged, never raised)."""
    ran = set(ran)
    try:
        old = read_job_errors(storage)
        new = updated_job_errors(old, number, ran, errors, time.time())
        if new == old:
            return None
        body = {"jobs": {job: {k: v for k, v in asdict(e).items() if k != "job"} for job, e in new.items()}}
        storage.put(JOB_ERRORS_PATH, json.dumps(body, sort_keys=True, indent=1).encode())
        return new
    except Exception:  # noqa: BLE001 - the record only reports: a failure to write it fails no round
        log.warning("round %d: could not record job errors in %s", number, JOB_ERRORS_PATH, exc_info=True)
        return None


# ------------------------------------------------------------------------------------ table health


@dataclass(frozen=True)
class CompactionHealth:
    """The compaction debt (`compaction.debt`) against the default `CompactionSettings`."""

    small_fragments: int  # fragments with fewer physical rows than small_fragment_rows
    mostly_deleted_fragments: int  # fragments with at least max_deleted_share of their rows deleted
    due: bool  # `compact` (and the maintain loop's compact job) would rewrite now
    small_fragment_rows: int
    min_small_fragments: int
    max_deleted_share: float


@dataclass(frozen=True)
class IndexHealth:
    """One base index: its segments and the base rows it covers."""

    name: str
    index_type: str
    maintained: bool  # index catch-up keeps it covering merged generations
    segments: int
    rows_indexed: int  # live rows in the fragments its segments cover (Lance's num_rows_indexed)
    base_rows: int  # live rows of the base table
    unindexed_fragments: int  # base fragments no segment covers
    unindexed_rows: int  # their live rows


@dataclass(frozen=True)
class Health:
    """The base table's shape, its indexes and the maintain loop's job errors."""

    fragments: int
    fragments_with_deletions: int
    physical_rows: int
    deleted_rows: int
    deleted_share: float  # deleted_rows / physical_rows
    compaction: CompactionHealth
    indexes: tuple[IndexHealth, ...] = ()
    job_errors: dict[str, JobError] = field(default_factory=dict)

    @property
    def failing_jobs(self) -> list[str]:
        """Jobs whose last failure is not resolved yet."""
        return sorted(j for j, e in self.job_errors.items() if not e.resolved)


def table_health(
    ds: lance.LanceDataset,
    details: pb.MemWalIndexDetails | None,
    storage: Storage,
    settings: CompactionSettings = compaction.DEFAULT_SETTINGS,
) -> Health:
    """The health of base version `ds` (manifest metadata only) and the recorded job errors;
    `details`: the MemWAL index details (which indexes are maintained)."""
    debt = compaction.debt(ds, settings)
    live = {s.fragment_id: s.physical_rows - s.deleted_rows for s in compaction.fragment_stats(ds)}
    base_rows = sum(live.values())
    described = [d for d in ds.describe_indices() if d.name != memwal_index.MEMWAL_INDEX_NAME]
    maintained = (
        index_catchup.maintained_index_names(details, {d.name for d in described}) if details else set()
    )
    indexes = []
    for d in sorted(described, key=lambda d: d.name):
        covered = {f for s in d.segments for f in (s.fragment_ids or ())}
        missing = [f for f in live if f not in covered]
        indexes.append(
            IndexHealth(
                name=d.name,
                index_type=str(d.index_type),
                maintained=d.name in maintained,
                segments=len(d.segments),
                rows_indexed=int(d.num_rows_indexed or 0),
                base_rows=base_rows,
                unindexed_fragments=len(missing),
                unindexed_rows=sum(live[f] for f in missing),
            )
        )
    return Health(
        fragments=debt.fragments,
        fragments_with_deletions=debt.with_deletions,
        physical_rows=debt.physical_rows,
        deleted_rows=debt.deleted_rows,
        deleted_share=debt.deleted_share,
        compaction=CompactionHealth(
            small_fragments=len(debt.small),
            mostly_deleted_fragments=len(debt.mostly_deleted),
            due=debt.due,
            small_fragment_rows=settings.small_fragment_rows,
            min_small_fragments=settings.min_small_fragments,
            max_deleted_share=settings.max_deleted_share,
        ),
        indexes=tuple(indexes),
        job_errors=read_job_errors(storage),
    )
