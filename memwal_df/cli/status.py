"""`memwal status`: the base table's health (fragments, deletion files, compaction debt, index
segments and coverage, the maintain loop's last error per job), regions, writer epochs, generations,
merge and index catch-up progress, and the registered change-feed consumers (how far behind each is,
whether it still pins garbage collection). Exits with code 1 when a region manifest, WAL entry or
unmerged generation is corrupt."""

from __future__ import annotations

import argparse
import datetime
import time
from typing import Any

from memwal_df.cli import common as c
from memwal_df.format import base_manifest, memwal_index
from memwal_df.table import RegionStatus, Table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show health, regions, epochs, generations, merge and index catch-up progress",
        description="The base table's health (fragments, deletion files, compaction debt, each base "
        "index's segments and coverage, the maintain loop's last error per job); regions (one row "
        "each), their writer epoch, flushed and merged generations, WAL positions and, per maintained "
        "base index, the generation its catch-up covers; then each region whose manifest or "
        "unreplayed WAL entry cannot be decoded, and each unmerged generation whose files do not match "
        "their checksums (file and error; exit code 1); then the registered change-feed consumers.",
    )
    c.add_table(p)
    p.add_argument(
        "--no-wal-check",
        action="store_true",
        help="do not decode the unflushed WAL entries (one read per entry) to find corrupt ones",
    )
    p.add_argument(
        "--no-generation-check",
        action="store_true",
        help="do not verify the files of unmerged generations against their checksums (reads them all)",
    )
    c.add_json(p)
    p.set_defaults(run=run)


def collect(table: Table, check_wal: bool = True, check_generations: bool = True) -> dict[str, Any]:
    """`table.status()` plus, per region, the unmerged generations and each index's catch-up."""
    st = table.status(check_wal=check_wal, check_generations=check_generations)
    catchup = memwal_index.index_catchup(table.details)
    regions = []
    for r in st["regions"]:
        d = c.plain(r)
        d["values_text"] = _values_text(table, r)
        d["unmerged_generations"] = [g for g, _ in r.flushed_generations if g > r.merged_generation]
        d["index_catchup"] = {name: per.get(r.region_id, 0) for name, per in sorted(catchup.items())}
        regions.append(d)
    return {
        **c.plain(st),
        "region_spec_text": table.spec_text(),
        "indexes": sorted({m.name for m in base_manifest.read_index_section(table.storage)[1]}),
        "region_snapshot_ms": table.details.snapshot_ts_millis or None,  # the last build-index
        "regions": regions,
        "consumers": _consumers(table, st["regions"]),
    }


def _consumers(table: Table, regions: list[RegionStatus]) -> list[dict[str, Any]]:
    """Each registered change-feed consumer: when it last committed, whether it still pins garbage
    collection (committed within its expiry), and how many flushed generations it has not read."""
    now = time.time()
    out = []
    for consumer in table.consumers():
        behind = sum(max(0, r.current_generation - consumer.offsets.of(r.region_id)[0]) for r in regions)
        out.append(
            {
                "consumer_id": consumer.consumer_id,
                "committed_at": consumer.committed_at,
                "expiry_s": consumer.expiry.total_seconds(),
                "pins": consumer.pins(now),
                "generations_behind": behind,
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    info = collect(
        c.table_of(args), check_wal=not args.no_wal_check, check_generations=not args.no_generation_check
    )
    c.emit(args, info, lambda: text(info))
    return c.Exit.FAILED if info["corrupt_regions"] else c.Exit.OK


def text(info: dict[str, Any]) -> str:
    maintained = info["maintained_indexes"]
    indexes = [i for i in info["indexes"] if i != memwal_index.MEMWAL_INDEX_NAME]
    head = [
        f"table        {info['uri']}",
        f"base         version {info['base_version']}, {c.count(info['base_rows'], 'row')}",
        f"primary key  {', '.join(info['primary_key'])}",
        f"region spec  {info['region_spec_text']}",
        f"snapshot     {_snapshot_text(info['region_snapshot_ms'])}",
        f"indexes      {', '.join(indexes) or 'none'} (maintained: "
        f"{maintained if maintained == 'all' else ', '.join(maintained) or 'none'})",
    ]
    head += health_text(info["health"])
    regions = info["regions"]
    corrupt = _corrupt_text(info)
    if not regions:
        return "\n".join([*head, "", "no readable regions" if corrupt else "no regions yet", *corrupt])
    names = sorted({n for r in regions for n in r["index_catchup"]})
    headers = ["region", "values", "epoch", "manifest", "next gen", "flushed", "merged", "unmerged"]
    headers += ["WAL seen", "replay after", *(f"catch-up {n}" for n in names)]
    rows = [
        [
            r["region_id"][:8],
            r["values_text"] or "",
            r["writer_epoch"],
            r["manifest_version"],
            r["current_generation"],
            _gens([g for g, _ in r["flushed_generations"]]),
            r["merged_generation"],
            _gens(r["unmerged_generations"]),
            r["wal_entry_position_last_seen"],
            r["replay_after_wal_entry_position"],
            *(r["index_catchup"][n] for n in names),
        ]
        for r in regions
    ]
    unmerged = sum(len(r["unmerged_generations"]) for r in regions)
    foot = f"{c.count(len(regions), 'region')}, {c.count(unmerged, 'flushed generation')} not merged yet"
    return "\n".join([*head, "", c.text_table(headers, rows), "", foot, *corrupt, *_consumers_text(info)])


def health_text(health: dict[str, Any]) -> list[str]:
    """The health block: fragments, compaction debt, one line per base index, the job errors."""
    share = f"{health['deleted_share']:.1%}"
    lines = [
        f"fragments    {c.count(health['fragments'], 'fragment')}, "
        f"{health['fragments_with_deletions']:,} with deletion files, {share} of rows deleted",
    ]
    k = health["compaction"]
    lines.append(
        f"compaction   {'due' if k['due'] else 'not due'}: {c.count(k['small_fragments'], 'small fragment')} "
        f"(< {k['small_fragment_rows']:,} rows; due at {k['min_small_fragments']:,}), "
        f"{k['mostly_deleted_fragments']:,} mostly deleted (>= {k['max_deleted_share']:.0%} of rows)"
    )
    for i in health["indexes"]:
        kind = i["index_type"] + (", maintained" if i["maintained"] else "")
        line = (
            f"index        {i['name']} ({kind}): {c.count(i['segments'], 'segment')}, "
            f"{i['rows_indexed']:,} of {c.count(i['base_rows'], 'row')} indexed"
        )
        if i["unindexed_fragments"]:
            missing = c.count(i["unindexed_fragments"], "fragment")
            line += f"; {missing} ({c.count(i['unindexed_rows'], 'row')}) not covered"
        lines.append(line)
    errors = health["job_errors"]
    if not errors:
        lines.append("job errors   none recorded by memwal maintain")
    for n, (job, e) in enumerate(sorted(errors.items())):
        label = "job errors   " if n == 0 else " " * 13
        failed = f"{_utc(e['failed_at'])}, round {e['round']}: {e['error_type']}: {e['message']}"
        if e["resolved_at"] is None:
            streak = f" ({e['failures']} rounds in a row)" if e["failures"] > 1 else ""
            lines.append(f"{label}{job}: FAILING{streak}; last failure {failed}")
        else:
            lines.append(f"{label}{job}: resolved {_utc(e['resolved_at'])}; last failure {failed}")
    return lines


def _utc(seconds: float) -> str:
    return f"{datetime.datetime.fromtimestamp(seconds, datetime.UTC):%Y-%m-%d %H:%M:%S} UTC"


def _consumers_text(info: dict[str, Any]) -> list[str]:
    """A table of the change-feed consumers (nothing when there are none)."""
    if not info["consumers"]:
        return []
    headers = ["consumer", "committed (UTC)", "expiry", "pins GC", "generations behind"]
    rows = [
        [
            k["consumer_id"],
            f"{datetime.datetime.fromtimestamp(k['committed_at'], datetime.UTC):%Y-%m-%d %H:%M:%S}",
            str(datetime.timedelta(seconds=round(k["expiry_s"]))),
            "yes" if k["pins"] else "no (expired)",
            k["generations_behind"],
        ]
        for k in info["consumers"]
    ]
    return ["", "change-feed consumers (docs/changes.md):", c.text_table(headers, rows)]


def _corrupt_text(info: dict[str, Any]) -> list[str]:
    """Lines naming each corrupt region, its file and error, and the repair command."""
    corrupt = info["corrupt_regions"]
    if not corrupt:
        return []
    lines = [
        "",
        f"CORRUPT: {c.count(len(corrupt), 'damaged file')} (undecodable, or not matching its checksum):",
    ]
    for p in corrupt:
        lines.append(f"  region {p['region_id']}: {p['kind']} {p['path']}")
        lines.append(f"    {p['error']}")
    lines.append(f"see `memwal repair {info['uri']} --region REGION` (docs/operations.md)")
    return lines


def _values_text(table: Table, region: RegionStatus) -> str | None:
    """The region's values labelled with their fields (`id=2`); None for a region without values."""
    spec = table.specs.get(region.spec_id)
    if region.values is None or spec is None:
        return None
    return spec.value_text(region.values, table.schema.names_by_id)


def _snapshot_text(ms: int | None) -> str:
    if ms is None:
        return "none (build-index never ran)"
    when = datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)
    return f"region snapshot of {when:%Y-%m-%d %H:%M:%S} UTC (build-index)"


def _gens(gens: list[int]) -> str:
    """Generation numbers, runs shortened: 1-4,7."""
    if not gens:
        return "-"
    parts: list[str] = []
    start: int | None = gens[0]  # None past the last run
    for prev, g in zip(gens, [*gens[1:], None], strict=True):
        if g is None or g != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = g
    return ",".join(parts)
