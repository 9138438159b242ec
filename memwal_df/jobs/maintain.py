"""The background-job loop: recovery of regions whose writer is gone, merge, MemWAL index build, base
index catch-up (with index upkeep), base compaction, base version cleanup and GC, round after round.

`maintain(table, interval=...)` runs the jobs in that order every `interval` seconds until `stop` is
set or `max_rounds` rounds ran. The `recover` job (`memwal_df.jobs.region_recovery`) replays the WAL of
each region whose writer lease expired or was released into a generation (never one with a live
writer), so the writes a crashed writer acknowledged become visible, and the merge of the same round
merges them. Compaction runs after catch-up so that the fragments it rewrites are
indexed alike (Lance compacts fragments of the same index coverage only) and before version cleanup,
which then frees the files it replaced. Version cleanup is the table's time-travel retention: base versions
older than `version_retention` go, except the newest `keep_versions` and tagged ones (Lance's
`cleanup_old_versions`, never `delete_unverified`, which would delete the files of a merge still
being written), so that GC, which keeps every generation a retained version reads, can free merged
generations and their WAL files.

A job that raises is logged (`CommitConflictError`, a lost race with another job or process, at
WARNING; `CorruptRegionsError`, a job done on every region but the corrupt ones it names, at ERROR
with its result kept; anything else with its traceback at ERROR) and simply runs again next round:
every job is safe to repeat and to race (see their modules). Each round's results and errors are kept in a
`Round`; the newest `history` rounds are returned. After each round the failures are recorded, and
the jobs that succeeded again marked resolved, in the table's job error record
(`memwal_df.jobs.health`, read by `table.status()`); a failure to record is logged, never raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import lance
from lance import CleanupStats

from memwal_df.errors import CommitConflictError, CorruptRegionsError, InvalidConfigError
from memwal_df.format import layout
from memwal_df.jobs import (
    compaction,
    garbage,
    health,
    index_builder,
    index_catchup,
    merger,
    region_recovery,
)
from memwal_df.jobs.compaction import CompactionSettings
from memwal_df.jobs.index_upkeep import IndexUpkeepSettings

if TYPE_CHECKING:
    from memwal_df.format.table_handle import TableHandle

log = logging.getLogger(__name__)

DEFAULT_VERSION_RETENTION = timedelta(days=1)


@dataclass(frozen=True)
class Round:
    """One round: each job's result (by job name) or its error, and when the round started."""

    number: int
    started: float  # time.time()
    results: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)


def maintain(
    table: TableHandle,
    *,
    interval: float = 60.0,
    stop: threading.Event | None = None,
    max_rounds: int | None = None,
    grace: timedelta = garbage.DEFAULT_GRACE,
    version_retention: timedelta | None = DEFAULT_VERSION_RETENTION,
    keep_versions: int | None = None,
    history: int = 100,
    compact: CompactionSettings | None = compaction.DEFAULT_SETTINGS,
    index_upkeep: IndexUpkeepSettings | None = None,
    on_round: Callable[[Round], None] | None = None,
) -> list[Round]:
    """Run the background jobs until `stop` is set or after `max_rounds` rounds; the newest
    `history` rounds, oldest first. `version_retention=None` keeps every base version (and so every
    generation a version reads); `compact=None` leaves the base uncompacted; `index_upkeep`: the
    bounds of index catch-up's optimizes (default `IndexUpkeepSettings()`); `on_round` is called
    with each round once it is recorded. Raises `InvalidConfigError` for a bad argument."""
    if interval < 0 or (max_rounds is not None and max_rounds < 1) or history < 1:
        raise InvalidConfigError(
            f"need interval >= 0, max_rounds >= 1, history >= 1; got {interval}, {max_rounds}, {history}"
        )
    if version_retention is not None and version_retention < timedelta(0):
        raise InvalidConfigError(f"version_retention must not be negative, got {version_retention}")
    if keep_versions is not None and keep_versions < 1:
        raise InvalidConfigError(f"keep_versions must be >= 1, got {keep_versions}")
    stop = stop or threading.Event()
    jobs: dict[str, Callable[[], Any]] = {
        "recover": lambda: region_recovery.recover_abandoned(table),
        "merge": lambda: merger.merge(table),
        "build_index": lambda: index_builder.build_index(table),
        "catch_up_indexes": lambda: index_catchup.catch_up_indexes(table, upkeep=index_upkeep),
    }
    if compact is not None:
        jobs["compact"] = lambda: compaction.compact(table, compact)
    if version_retention is not None:
        jobs["cleanup_versions"] = lambda: cleanup_versions(table, version_retention, keep_versions)
    jobs["gc"] = lambda: garbage.gc(table, grace=grace)
    rounds: deque[Round] = deque(maxlen=history)
    number = 0
    while not stop.is_set():
        number += 1
        done = run_round(number, jobs)
        health.record_round(table.storage, number, [*done.results, *done.errors], done.errors)
        rounds.append(done)
        if on_round is not None:
            on_round(done)
        if max_rounds is not None and number >= max_rounds:
            break
        stop.wait(interval)
    return list(rounds)


def cleanup_versions(table: TableHandle, older_than: timedelta, keep: int | None = None) -> CleanupStats:
    """Remove base versions older than `older_than` but the newest `keep` (never the latest, never a
    tagged one) and the files only they reference; files no version references are kept until
    Lance's own 7-day cut-off, as they may belong to a commit in flight.

    The base is made durable first (a version this removes may be the one a power loss would fall
    back to if a newer one, committed by another process, was not yet synced), and the removals
    when it returns."""
    ds = lance.dataset(table.uri, storage_options=table.storage_options or None)
    table.storage.sync_tree("", skip=layout.NOT_BASE)
    with table.storage.synced_changes(skip=layout.NOT_BASE):
        return ds.cleanup_old_versions(
            older_than=older_than,
            retain_versions=keep,
            delete_unverified=False,
            error_if_tagged_old_versions=False,
        )


def run_round(number: int, jobs: dict[str, Callable[[], Any]]) -> Round:
    """Run each job once, in order; an error is logged and recorded, and the next job still runs."""
    done = Round(number, time.time())
    for name, job in jobs.items():
        start = time.perf_counter()
        try:
            done.results[name] = job()
        except CorruptRegionsError as e:
            done.results[name], done.errors[name] = e.result, e
            log.error("round %d: %s skipped corrupt regions, retrying next round: %s", number, name, e)
        except CommitConflictError as e:
            done.errors[name] = e
            log.warning("round %d: %s lost a race, retrying next round: %s", number, name, e)
        except Exception as e:  # noqa: BLE001 - a long-running service logs and retries every job
            done.errors[name] = e
            log.exception("round %d: %s failed, retrying next round", number, name)
        else:
            log.info(
                "round %d: %s done in %.3fs: %s",
                number,
                name,
                time.perf_counter() - start,
                _summary(done.results[name]),
            )
    return done


def _summary(result: Any) -> str:
    for attr in ("recovered", "generations", "caught_up", "compacted", "removed", "version"):
        if hasattr(result, attr):
            return f"{attr}={getattr(result, attr)}"
    return repr(result)
