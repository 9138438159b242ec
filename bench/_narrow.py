"""The narrow-schema workload of `bench/read.py --narrow`: the SQL shapes people run, through DataFusion
over `MemWalTable(uri)` and over the same rows as a plain Lance table through Lance's own DataFusion
provider (`lance.FFILanceTableProvider`): the floor memwal_df's SQL is judged against.

Table: `id` int64 primary key, `category` string (20 values, c0..c19), `value` float64 in [0, 1); a
base of `--rows` rows (ids 0..rows-1, no index), 4 bucket regions, `--upserts` upserts (default 20% of
the base; half updates of distinct base keys, half new keys) in `--batch`-row puts, flushed into ~40
generations (`max_memtable_rows` = upserts / 40 per region) and left unmerged. The plain table holds
the deduplicated rows, computed from the generated data (not read through memwal_df) and written with
`lance.write_dataset`; it is the model every answer is checked against.

Measured in one process and one SessionContext, each shape in `--repeat` rounds in which the two
engines take turns (median shown); then the same after `Table.merge()` (0 unmerged generations).
Every memwal_df answer is compared with plain Lance's (sorted; float columns to 1e-9 relative; for
`LIMIT` without `ORDER BY`: the row count, and that every row returned is a row of the model): a
mismatch is printed and the run exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from _cli import print_checks, print_total, run_environment, write_json
from _workload import NUM_REGIONS, scale_note, scratch_root, targets_markdown, time_rounds
from _workload import SCHEMA as WORKLOAD_SCHEMA

import memwal_df as mw
from memwal_df.read.lsm.snapshot import take_snapshot

SQL = "memwal_df SQL"
PLAIN = "plain Lance via DataFusion"
BASE = "Lance via DataFusion over the merged base"  # the same rows, in the merged base's layout
UNMERGED, MERGED = "unmerged", "merged"
CATEGORIES = pa.array([f"c{i}" for i in range(20)])
GENERATIONS = 40  # generations the upserts are flushed into (about; 4 regions)
MAX_RATIO = 1.5
MAX_COUNT_MS = 5.0
SCHEMA = pa.schema([WORKLOAD_SCHEMA.field(name) for name in ("id", "category", "value")])


@dataclass(frozen=True)
class Shape:
    name: str
    sql: str  # `{t}`: the table
    ordered: bool = True  # False: LIMIT without ORDER BY (any rows of the table will do)


def shapes(key_lo: int, key_hi: int) -> list[Shape]:
    return [
        Shape("SELECT *", "SELECT * FROM {t}"),
        Shape("SELECT id", "SELECT id FROM {t}"),
        Shape("count(*)", "SELECT count(*) FROM {t}"),
        Shape("ORDER BY value LIMIT 10", "SELECT * FROM {t} ORDER BY value LIMIT 10"),
        Shape("GROUP BY category", "SELECT category, count(*), avg(value) FROM {t} GROUP BY category"),
        Shape("WHERE value < 0.1", "SELECT * FROM {t} WHERE value < 0.1"),
        Shape("count(*) WHERE category = 'c3'", "SELECT count(*) FROM {t} WHERE category = 'c3'"),
        Shape(
            f"key range ({key_hi - key_lo + 1:,} keys)",
            f"SELECT * FROM {{t}} WHERE id BETWEEN {key_lo} AND {key_hi}",
        ),
        Shape("LIMIT 10", "SELECT * FROM {t} LIMIT 10", ordered=False),
    ]


# --------------------------------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------------------------------


@dataclass
class Data:
    base: pa.Table
    upserts: list[pa.Table]  # one table per put
    model: pa.Table  # the deduplicated rows; row i holds id i


def make_data(rows: int, upserts: int, batch: int, seed: int = 7) -> Data:
    """Base ids 0..rows-1; upserts half updates of distinct base keys, half new keys from `rows` up."""
    rng = np.random.default_rng(seed)
    n_new = upserts - upserts // 2
    ids = np.concatenate([rng.choice(rows, upserts // 2, replace=False), np.arange(rows, rows + n_new)])
    rng.shuffle(ids)
    cat = rng.integers(0, len(CATEGORIES), rows + upserts)
    val = rng.random(rows + upserts)

    def table(ids: np.ndarray, cat: np.ndarray, val: np.ndarray) -> pa.Table:
        columns = [pa.array(ids, pa.int64()), CATEGORIES.take(pa.array(cat)), pa.array(val)]
        return pa.Table.from_arrays(columns, schema=SCHEMA)

    model_cat = np.concatenate([cat[:rows], np.zeros(n_new, cat.dtype)])
    model_val = np.concatenate([val[:rows], np.zeros(n_new)])
    model_cat[ids], model_val[ids] = cat[rows:], val[rows:]  # ids are distinct: each key's last version
    put = [slice(lo, lo + batch) for lo in range(0, upserts, batch)]
    return Data(
        base=table(np.arange(rows), cat[:rows], val[:rows]),
        upserts=[table(ids[s], cat[rows:][s], val[rows:][s]) for s in put],
        model=table(np.arange(rows + n_new), model_cat, model_val),
    )


@dataclass
class Built:
    table: mw.Table
    plain_uri: str
    generations: int
    timings: dict[str, float]


def build(root: Path, data: Data, memtable_rows: int) -> Built:
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    t = mw.create_table(
        str(root / "t"), data.base, primary_key="id", region_spec=mw.bucket("id", NUM_REGIONS)
    )
    timings["create_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    w = t.writer(max_memtable_rows=memtable_rows)
    for b in data.upserts:
        w.put(b)
    w.close()
    timings["upserts_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain_uri = str(root / "plain")
    lance.write_dataset(data.model, plain_uri)
    timings["plain_s"] = time.perf_counter() - t0
    t.refresh()
    generations = sum(len(r.levels) for r in take_snapshot(t).regions)
    return Built(t, plain_uri, generations, timings)


def layout(uri: str) -> dict[str, int]:
    """Fragments, fragments with a deletion file and deleted rows of the Lance table at `uri` (a merge
    adds all three to the base)."""
    ds = lance.dataset(uri)
    fragments = ds.get_fragments()
    physical = sum(f.metadata.physical_rows or 0 for f in fragments)
    return {
        "fragments": len(fragments),
        "deletion_files": sum(f.metadata.deletion_file is not None for f in fragments),
        "deleted_rows": physical - ds.count_rows(),
    }


# --------------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------------


def _by_position(t: pa.Table) -> pa.Table:
    """`t` with columns named by position (DataFusion names aggregates after the table), sorted by all."""
    t = t.rename_columns([f"c{i}" for i in range(t.num_columns)])
    return t.sort_by([(c, "ascending") for c in t.column_names])


def _same_columns(ours: pa.Table, ref: pa.Table) -> str | None:
    for i, (a, b) in enumerate(zip(ours.columns, ref.columns, strict=True)):
        b = b.cast(a.type) if b.type != a.type else b
        if pa.types.is_floating(a.type):
            same = np.allclose(a.to_numpy(), b.to_numpy(), rtol=1e-9, atol=0.0)
        else:
            same = a.equals(b)
        if not same:
            return f"column {i} differs"
    return None


def mismatch(shape: Shape, ours: pa.Table, plain: pa.Table, model: pa.Table) -> str | None:
    """Why memwal_df's answer is wrong (None when it is right): against plain Lance's answer, or for a
    LIMIT without ORDER BY, against plain Lance's row count and the model's rows."""
    if ours.num_columns != plain.num_columns or ours.num_rows != plain.num_rows:
        ours_shape, plain_shape = (
            f"{ours.num_rows:,} x {ours.num_columns}",
            f"{plain.num_rows:,} x {plain.num_columns}",
        )
        return f"{ours_shape} rows x columns, plain Lance {plain_shape}"
    if not shape.ordered:
        ours_sorted = ours.sort_by("id")
        ids = ours_sorted.column("id")
        if pc.any(pc.greater_equal(ids, model.num_rows)).as_py():
            return "a key that is not in the table"
        plain = model.take(ids)
        return _same_columns(_by_position(ours_sorted), _by_position(plain))
    return _same_columns(_by_position(ours), _by_position(plain))


# --------------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------------


@dataclass
class Result:
    phase: str
    shape: str
    sql: str
    engine: str
    samples_s: list[float]
    rows: int

    @property
    def ms(self) -> float:
        return statistics.median(self.samples_s) * 1e3

    def summary(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "shape": self.shape,
            "sql": self.sql,
            "engine": self.engine,
            "rows": self.rows,
            "median_s": self.ms / 1e3,
            "samples_s": self.samples_s,
        }


def _query(
    ctx: datafusion.SessionContext, sql: str, answers: dict[str, pa.Table], engine: str
) -> Callable[[], int]:
    """A timed run: the query's answer, kept in `answers[engine]`; returns its row count."""

    def fn() -> int:
        answers[engine] = ctx.sql(sql).to_arrow_table()
        return answers[engine].num_rows

    return fn


def measure(
    ctx: datafusion.SessionContext,
    phase: str,
    engines: list[tuple[str, str]],
    data: Data,
    todo: list[Shape],
    repeat: int,
) -> tuple[list[Result], list[str]]:
    """Each shape over every (engine, table), `repeat` rounds taking turns; the results, and every
    answer that differs from the `PLAIN` engine's."""
    results, bad = [], []
    for shape in todo:
        answers: dict[str, pa.Table] = {}
        fns = [_query(ctx, shape.sql.format(t=table), answers, engine) for engine, table in engines]
        timed = [
            Result(phase, shape.name, shape.sql.format(t="t"), engine, samples, rows)
            for (engine, _), (samples, rows) in zip(engines, time_rounds(fns, repeat), strict=True)
        ]
        results += timed
        print(
            f"  {phase:<9} {shape.name:<32} "
            + "   ".join(f"{r.engine} {r.ms:9.1f} ms" for r in timed)
            + f"   {timed[-1].rows:,} rows",
            flush=True,
        )
        for engine, _ in engines:
            if engine != PLAIN and (why := mismatch(shape, answers[engine], answers[PLAIN], data.model)):
                bad.append(f"{phase}: {shape.name}: {engine}: {why}")
                print(f"MISMATCH {bad[-1]}", flush=True)
    return results, bad


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def ratios(results: list[dict[str, Any]], phase: str) -> dict[str, tuple[float, float]]:
    """Shape -> (memwal_df ms, plain Lance ms) of one phase, from the JSON results."""
    ms = {(r["shape"], r["engine"]): r["median_s"] * 1e3 for r in results if r["phase"] == phase}
    return {s: (ms[(s, SQL)], ms[(s, PLAIN)]) for s, e in ms if e == SQL}


def targets(results: list[dict[str, Any]], rows: int, generations: int) -> list[dict[str, Any]]:
    """Per shape (unmerged): memwal_df SQL within 1.5x plain Lance's time; count(*) also <= 5 ms."""
    out = []
    scale = scale_note(rows)
    for shape, (ours, plain) in ratios(results, UNMERGED).items():
        name = f"narrow, {generations} generations: `{shape}` <= {MAX_RATIO}x plain Lance via DataFusion"
        out.append(
            {
                "target": name + scale,
                "measured": f"{ours / plain:.2f}x ({ours:,.1f} against {plain:,.1f} ms)",
                "met": ours / plain <= MAX_RATIO,
            }
        )
        if shape == "count(*)":
            out.append(
                {
                    "target": f"narrow, {generations} generations: `count(*)` <= {MAX_COUNT_MS:g} ms" + scale,
                    "measured": f"{ours:,.1f} ms",
                    "met": ours <= MAX_COUNT_MS,
                }
            )
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    ms = {(r["phase"], r["shape"], r["engine"]): r["median_s"] * 1e3 for r in results}
    lines = [
        "| SQL shape | memwal_df SQL ms | plain Lance ms | ratio | target | merged: memwal_df SQL ms "
        "| merged: plain Lance ms | merged: ratio | merged: Lance over the merged base ms |",
        "|---|--:|--:|--:|---|--:|--:|--:|--:|",
    ]
    for shape, (ours, plain) in ratios(results, UNMERGED).items():
        target = f"<= {MAX_RATIO}x" + (f"; <= {MAX_COUNT_MS:g} ms" if shape == "count(*)" else "")
        after = [ms.get((MERGED, shape, e)) for e in (SQL, PLAIN, BASE)]
        cells = ["-" if x is None else f"{x:,.1f}" for x in after]
        cells.insert(2, f"{after[0] / after[1]:.2f}x" if after[0] and after[1] else "-")
        row = [shape, f"{ours:,.1f}", f"{plain:,.1f}", f"{ours / plain:.2f}x", target, *cells]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """`bench/read.py --narrow`: build, measure unmerged then merged, print, write `args.json`; exit code 1
    when an answer differs from plain Lance's."""
    rows = args.rows or (100_000 if args.small else 1_000_000)
    upserts = args.upserts or rows // 5
    mt_rows = args.memtable_rows or max(upserts // GENERATIONS, 1)
    root = scratch_root(args.dir, "narrow-")
    t_start = time.perf_counter()
    try:
        t0 = time.perf_counter()
        data = make_data(rows, upserts, args.batch)
        generate_s = time.perf_counter() - t0
        built = build(root, data, mt_rows)
        timings = {"generate_s": generate_s, **built.timings}
        print(
            f"# bench/read.py --narrow: base {rows:,} rows (id, category, value), {upserts:,} upserts in "
            f"{args.batch:,}-row batches (half updates) -> {built.generations} unmerged generations in "
            f"{NUM_REGIONS} bucket regions (max_memtable_rows {mt_rows:,}); plain Lance table of the "
            f"{data.model.num_rows:,} deduplicated rows. Built in {sum(timings.values()):.1f}s; tables "
            f"under {root}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
            flush=True,
        )
        width = min(20_000, rows // 5)
        todo = shapes(rows // 3, rows // 3 + width - 1)
        ctx = mw.register(datafusion.SessionContext())
        ctx.register_table("plain", lance.FFILanceTableProvider(lance.dataset(built.plain_uri)))
        ctx.register_table("t", mw.MemWalTable(built.table.uri))
        print(f"SQL shapes ({args.repeat} round(s), engines taking turns; median):", flush=True)
        results, bad = measure(ctx, UNMERGED, [(SQL, "t"), (PLAIN, "plain")], data, todo, args.repeat)
        t0 = time.perf_counter()
        merged_rows = built.table.merge().rows
        timings["merge_s"] = time.perf_counter() - t0
        merged_base = layout(built.table.uri)
        ctx.register_table("merged", mw.MemWalTable(built.table.uri))
        ctx.register_table("base", lance.FFILanceTableProvider(lance.dataset(built.table.uri)))
        engines = [(SQL, "merged"), (BASE, "base"), (PLAIN, "plain")]
        more, more_bad = measure(ctx, MERGED, engines, data, todo, args.repeat)
        summary = [r.summary() for r in results + more]
        bad += more_bad
        tgt = targets(summary, rows, built.generations)
        print()
        print(markdown(summary))
        print(
            f"\nmerged: {merged_rows:,} rows merged in {timings['merge_s']:.1f}s, 0 unmerged generations; "
            f"the base now has {merged_base['fragments']} fragments and {merged_base['deleted_rows']:,} "
            f"deleted rows (plain Lance: {layout(built.plain_uri)['fragments']} fragments).\n"
        )
        print(targets_markdown(tgt))
        print_checks(
            bad,
            "memwal_df's answer differs",
            "memwal_df's answers equal plain Lance's (and the model's) for every shape.",
        )
        total = print_total(t_start)
        if args.json:
            config = {
                "workload": "narrow",
                "base_rows": rows,
                "upserts": upserts,
                "batch": args.batch,
                "memtable_rows": mt_rows,
                "generations": built.generations,
                "base_after_merge": merged_base,
                "repeat": args.repeat,
                "build": timings,
                "total_s": total,
                **run_environment(),
            }
            write_json(args.json, {"config": config, "results": summary, "targets": tgt, "mismatches": bad})
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if bad else 0
