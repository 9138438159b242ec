"""The background jobs as commands: `merge`, `build-index`, `compact`, `gc`, `recover`, `repair` and
the `maintain` loop (`python -m memwal_df maintain` runs the same code). Each prints what it did
(`--json`: the job's result object as data)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from memwal_df.cli import common as c
from memwal_df.errors import CorruptRegionsError, InvalidArgumentError
from memwal_df.format.layout import parse_region_id
from memwal_df.jobs import compaction as _compaction
from memwal_df.jobs import garbage as _gc
from memwal_df.jobs import health as _health
from memwal_df.jobs import maintain as _maintain
from memwal_df.jobs import merger
from memwal_df.jobs.compaction import CompactionSettings
from memwal_df.jobs.index_upkeep import IndexUpkeepSettings


def register(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser(
        "merge",
        help="merge flushed generations into the base table",
        description="Merge flushed generations into the base table, in order, per region.",
    )
    c.add_table(m)
    m.add_argument("--region", action="append", help="only this region id (repeat)")
    m.add_argument("--max-generations", type=int, help="at most this many generations per region")
    m.add_argument("--parallel", action="store_true", help="merge regions in parallel threads")
    m.add_argument(
        "--generations-per-commit",
        type=int,
        default=merger.GENERATIONS_PER_COMMIT,
        help="consecutive generations of a region merged in one commit (default %(default)s)",
    )
    c.add_json(m)
    m.set_defaults(
        run=_job(
            lambda t, a: t.merge(a.region, a.max_generations, a.parallel, a.generations_per_commit),
            _merge_text,
        )
    )

    b = sub.add_parser(
        "build-index",
        help="snapshot region states into the MemWAL index",
        description="Run the MemWAL index builder: snapshot every region's state into the MemWAL index "
        "(read by --consistency snapshot) and advance stale WAL hints.",
    )
    c.add_table(b)
    c.add_json(b)
    b.set_defaults(run=_job(lambda t, a: t.build_index(), _build_text))

    k = sub.add_parser(
        "compact",
        help="rewrite the base table's small and mostly deleted fragments",
        description="Measure the base table's compaction debt (small fragments, fragments with many "
        "deleted rows) and, when it passes the thresholds, rewrite those fragments only into "
        "fragments of up to --target-rows-per-fragment rows, dropping deleted rows. The MemWAL index "
        "and index catch-up are kept; indexes are remapped in the same commit. Prints the debt found "
        "and what was rewritten.",
    )
    c.add_table(k)
    _compaction_args(k)
    c.add_json(k)
    k.set_defaults(run=_job(lambda t, a: t.compact(_compaction_settings(a)), _compact_text, _compact_data))

    g = sub.add_parser(
        "gc",
        help="remove merged generations, their WAL entries and old manifests",
        description="Remove merged generations no reader can still need, their WAL entries, orphaned "
        "generation directories and old region manifest versions.",
    )
    c.add_table(g)
    _grace(g)
    g.add_argument(
        "--keep-manifest-versions",
        type=int,
        default=_gc.DEFAULT_KEEP_MANIFEST_VERSIONS,
        help=f"region manifest versions kept (default {_gc.DEFAULT_KEEP_MANIFEST_VERSIONS})",
    )
    c.add_json(g)
    g.set_defaults(run=_job(_run_gc, _gc_text))

    r = sub.add_parser(
        "recover",
        help="replay and flush WAL entries of crashed writers",
        description="Claim every region whose WAL holds entries no generation covers, replay and flush "
        "them (fences any writer still active on those regions).",
    )
    c.add_table(r)
    c.add_json(r)
    r.set_defaults(run=_job(lambda t, a: t.recover(), _recover_text, lambda r: {"recovered": c.plain(r)}))

    p = sub.add_parser(
        "repair",
        help="set a region's corrupt WAL entries aside, rebuild or set aside its corrupt generations",
        description="Show what repairing the region's WAL loses: the corrupt entry files (and, with "
        "--discard-later, the valid entries after a corrupt one, with their row counts). With --yes, "
        "claim the region with a new writer epoch (fencing any active writer), move those files to "
        "_mem_wal/REGION/quarantine/epoch-E/ (nothing is deleted) and put a fence sentinel in the first "
        "one's place, so writers and recover replay the region again. A corrupt entry followed by "
        "valid ones is refused without --discard-later: setting it aside alone would hide the later "
        "entries from replay. A corrupt unmerged generation is rebuilt from the WAL entries that hold "
        "its rows, or, when they are gone, dropped from the region manifest (its rows are lost); its "
        "files go to _mem_wal/REGION/quarantine/generations/.",
    )
    c.add_table(p)
    p.add_argument("--region", required=True, help="the region id (memwal status lists corrupt regions)")
    p.add_argument("--yes", action="store_true", help="do it (without: only show what would be lost)")
    p.add_argument(
        "--discard-later",
        action="store_true",
        help="also set aside the valid entries after a corrupt one in the middle of the WAL "
        "(their rows are lost)",
    )
    c.add_json(p)
    p.set_defaults(run=run_repair)

    add_maintain(sub)


def _run_merge(table: Any, a: argparse.Namespace) -> Any:
    return table.merge(a.region, a.max_generations, a.parallel, a.generations_per_commit)


def add_maintain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "maintain",
        help="run merge, index build, index catch-up, compaction and GC in a loop",
        description="Run merge, MemWAL index build, index catch-up, base compaction, version cleanup "
        "and GC every --interval seconds until interrupted (SIGINT/SIGTERM finish the current round, "
        "then exit). Each failed job is printed on stderr (also with --quiet) and recorded for "
        "`memwal status`. Exit code 1 when the last round had a failed job.",
    )
    c.add_table(p)
    p.add_argument("--interval", type=float, default=60.0, help="seconds between rounds (default 60)")
    p.add_argument("--rounds", type=int, default=None, help="stop after this many rounds")
    _grace(p)
    p.add_argument(
        "--version-retention",
        type=float,
        default=_maintain.DEFAULT_VERSION_RETENTION.total_seconds(),
        help="remove base versions older than this many seconds each round (default %(default).0f)",
    )
    p.add_argument("--keep-versions", type=int, default=None, help="but always keep this many newest")
    p.add_argument("--no-compact", action="store_true", help="never compact the base table")
    _compaction_args(p)
    upkeep = IndexUpkeepSettings()
    p.add_argument(
        "--max-index-segments",
        type=int,
        default=upkeep.max_segments,
        help="merge an index's segments into one when it would have more (default %(default)s)",
    )
    p.add_argument(
        "--retrain-share",
        type=float,
        default=upkeep.retrain_share,
        help="retrain a vector index once the rows added since its training pass this share of the "
        "rows it was trained on (default: never)",
    )
    p.add_argument("--quiet", action="store_true", help="log warnings only (failed jobs are still printed)")
    c.add_json(p)
    p.set_defaults(run=run_maintain)


def _grace(p: argparse.ArgumentParser) -> None:
    default = _gc.DEFAULT_GRACE.total_seconds()
    p.add_argument("--grace", type=float, default=default, help=f"GC grace period in seconds ({default:.0f})")


_COMPACTION_FLAGS = (  # (setting, type, help)
    ("target_rows_per_fragment", int, "rows per rewritten fragment"),
    ("small_fragment_rows", int, "a fragment with fewer rows is small"),
    ("min_small_fragments", int, "compact once this many fragments are small"),
    ("max_deleted_share", float, "rewrite a fragment once this share of its rows is deleted"),
)


def _compaction_args(p: argparse.ArgumentParser) -> None:
    for name, kind, text in _COMPACTION_FLAGS:
        default = getattr(_compaction.DEFAULT_SETTINGS, name)
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default %(default)s)")


def _compaction_settings(args: argparse.Namespace) -> CompactionSettings:
    """The settings of the compaction flags (`InvalidConfigError`, exit code 2, for bad ones)."""
    return CompactionSettings(**{name: getattr(args, name) for name, _, _ in _COMPACTION_FLAGS})


def _job(
    call: Callable[[Any, argparse.Namespace], Any],
    text: Callable[[Any], str],
    data: Callable[[Any], dict[str, Any]] = c.plain,
) -> Callable:
    """A command running `call`; a job that skipped corrupt regions prints what it did on the others,
    then each skipped region and file (`--json`: `corrupt_regions`), and exits with code 1."""

    def run(args: argparse.Namespace) -> int:
        table = c.table_of(args)
        t0 = time.perf_counter()
        failed: Mapping[Any, Exception] = {}
        try:
            result = call(table, args)
        except CorruptRegionsError as e:
            result, failed = e.result, e.errors
        seconds = time.perf_counter() - t0
        c.emit(
            args,
            {**data(result), "seconds": round(seconds, 3), "corrupt_regions": c.plain(failed)},
            lambda: f"{text(result)} in {seconds:.2f}s" + _corrupt_text(args.uri, failed),
        )
        return c.Exit.FAILED if failed else c.Exit.OK

    return run


def _corrupt_text(uri: str, failed: Mapping[Any, Exception]) -> str:
    if not failed:
        return ""
    lines = [f"\nskipped {c.count(len(failed), 'corrupt region')}:"]
    lines += [f"  {r}: {e}" for r, e in sorted(failed.items())]
    lines.append(f"see `memwal repair {uri} --region REGION`")
    return "\n".join(lines)


def run_repair(args: argparse.Namespace) -> int:
    table = c.table_of(args)
    region_id = parse_region_id(args.region, "--region")
    plan = table.repair_region(region_id, apply=args.yes, discard_later=args.discard_later)
    hint = ""
    if (plan.entries or plan.covered or plan.generations) and not plan.applied:
        hint = "\nnothing was changed; run again with --yes to repair"
    elif plan.applied and plan.entries:
        hint = f"\nthe region can be claimed again: run `memwal recover {args.uri}` to replay it"
    c.emit(args, {**c.plain(plan), "rows_lost": plan.rows_lost}, lambda: plan.describe() + hint)
    return c.Exit.OK


def _run_gc(table: Any, args: argparse.Namespace) -> _gc.GcResult:
    if args.grace < 0:
        raise InvalidArgumentError("--grace must be >= 0 seconds")
    return table.gc(grace=timedelta(seconds=args.grace), keep_manifest_versions=args.keep_manifest_versions)


def _merge_text(r: Any) -> str:
    gens = sum(len(x.generations) for x in r.regions)
    regions = sum(1 for x in r.regions if x.generations)
    upserted, deleted = sum(x.rows_upserted for x in r.regions), sum(x.rows_deleted for x in r.regions)
    return (
        f"merged {c.count(gens, 'generation')} of {c.count(regions, 'region')}: "
        f"{c.count(upserted, 'row')} upserted, {c.count(deleted, 'tombstone')} applied; "
        f"base version {r.base_version}"
    )


def _build_text(r: Any) -> str:
    return (
        f"MemWAL index snapshot of {c.count(r.regions, 'region')}, {c.count(r.generations, 'generation')} "
        f"at base version {r.version} ({r.location}, {c.count(r.snapshot_bytes, 'byte')}); "
        f"{c.count(r.last_seen_advanced, 'WAL hint')} advanced"
    )


def _gc_text(r: Any) -> str:
    gens = sum(len(x.generations) for x in r.regions)
    wal = sum(len(x.wal_positions) for x in r.regions)
    orphans = sum(len(x.orphans) for x in r.regions)
    manifests = sum(len(x.manifest_versions) for x in r.regions)
    return (
        f"removed {c.count(gens, 'generation')}, {c.count(wal, 'WAL entry', 'WAL entries')}, "
        f"{c.count(orphans, 'orphaned directory', 'orphaned directories')} and "
        f"{c.count(manifests, 'manifest version')}"
    )


def _compact_data(r: _compaction.CompactionResult) -> dict[str, Any]:
    debt = {**c.plain(r.debt), "deleted_share": r.debt.deleted_share}
    return {**c.plain(r), "debt": debt, "compacted": r.compacted}


def _compact_text(r: _compaction.CompactionResult) -> str:
    d = r.debt
    found = (
        f"debt: {c.count(d.fragments, 'fragment')} ({d.with_deletions:,} with deletion files, "
        f"{d.deleted_share:.1%} of rows deleted), {c.count(len(d.small), 'small fragment')}, "
        f"{len(d.mostly_deleted):,} mostly deleted: {'due' if d.due else 'not due'}"
    )
    if not r.compacted:
        return f"{found}\nnothing rewritten; base version {r.version}"
    return (
        f"{found}\nrewrote {c.count(r.fragments_removed, 'fragment')} into {r.fragments_added:,} "
        f"({c.count(r.files_removed, 'data file')} into {r.files_added:,}); base version {r.version}"
    )


def _recover_text(recovered: list[Any]) -> str:
    return f"recovered {c.count(len(recovered), 'region')}" + "".join(f"\n  {x}" for x in recovered)


def run_maintain(args: argparse.Namespace) -> int:
    if args.interval < 0 or args.grace < 0 or (args.rounds is not None and args.rounds < 1):
        raise InvalidArgumentError("need --interval >= 0, --grace >= 0 and --rounds >= 1")
    if args.version_retention < 0 or (args.keep_versions is not None and args.keep_versions < 1):
        raise InvalidArgumentError("need --version-retention >= 0 and --keep-versions >= 1")
    compact = None if args.no_compact else _compaction_settings(args)
    upkeep = IndexUpkeepSettings(max_segments=args.max_index_segments, retrain_share=args.retrain_share)
    level = logging.WARNING if args.quiet or args.json else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    table = c.table_of(args)
    stop = threading.Event()
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        rounds = _maintain.maintain(
            table,
            interval=args.interval,
            stop=stop,
            max_rounds=args.rounds,
            grace=timedelta(seconds=args.grace),
            version_retention=timedelta(seconds=args.version_retention),
            keep_versions=args.keep_versions,
            compact=compact,
            index_upkeep=upkeep,
            on_round=_print_failures,
        )
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    summary = [
        {"round": r.number, "jobs": sorted({*r.results, *r.errors}), "errors": _errors_data(r.errors)}
        for r in rounds
    ]
    failed = {k for r in rounds for k in r.errors}
    corrupt = {
        region: err
        for e in (rounds[-1].errors.values() if rounds else ())
        if isinstance(e, CorruptRegionsError)
        for region, err in e.errors.items()
    }
    c.emit(
        args,
        summary,
        lambda: (
            c.count(len(rounds), "round")
            + (f"; failed jobs: {', '.join(sorted(failed))}" if failed else "; no errors")
            + _corrupt_text(args.uri, corrupt)
        ),
    )
    return c.Exit.FAILED if rounds and rounds[-1].errors else c.Exit.OK


def _errors_data(errors: Mapping[str, BaseException]) -> dict[str, dict[str, str]]:
    """Each failed job's error type and message (on one line), by job name."""
    return {
        job: {"error_type": type(e).__name__, "message": _health.one_line(e)}
        for job, e in sorted(errors.items())
    }


def _print_failures(done: _maintain.Round) -> None:
    """One line on stderr per failed job of the round (whatever the log level)."""
    for job, e in sorted(done.errors.items()):
        print(
            f"round {done.number}: {job} failed: {type(e).__name__}: {_health.one_line(e)}", file=sys.stderr
        )
