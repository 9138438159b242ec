"""The benchmark report: runs bench/write.py, read.py (and its narrow-schema workload, `read.py
--narrow`), search.py, merge.py and churn.py in one go (quick sizes
by default, the reference workload of docs/performance.md with `--full`), each with `--json`, then writes
bench/results/report.md and PNG charts from those JSON files (matplotlib, Agg backend).

    python bench/report.py                     # quick sizes
    python bench/report.py --full              # the reference workload (much longer)
    python bench/report.py --only write,merge  # some benchmarks
    python bench/report.py --no-run            # rebuild report.md and charts from existing JSON

Every figure in the report comes from the JSON the scripts wrote in this run; engines are compared
only within a run (ratios), as timings on a shared machine drift between runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
QUICK = {
    "write": ["--small"],
    "read": ["--small", "--repeat", "3", "--lookups", "100"],
    "narrow": ["--small", "--repeat", "3"],
    "search": ["--small"],
    "merge": ["--small"],
    "churn": ["--small"],
}
FULL: dict[str, list[str]] = {name: [] for name in QUICK}
SCRIPT = {"narrow": "read"}  # benchmark -> the script that runs it (default: bench/<benchmark>.py)
WORKLOAD = {"narrow": ["--narrow"]}  # benchmark -> the arguments that select its workload


def command(name: str, full: bool) -> list[str]:
    """The script and arguments of benchmark `name` (without `--json`)."""
    script = BENCH / f"{SCRIPT.get(name, name)}.py"
    return [str(script), *WORKLOAD.get(name, []), *(FULL if full else QUICK)[name]]


# ------------------------------------------------------------------------------------------- running


def run_benches(names: Sequence[str], full: bool, out: Path) -> dict[str, dict[str, Any]]:
    """Run each benchmark with `--json OUT/NAME.json`; per name its command, exit code and seconds."""
    runs = {}
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in names:
        cmd = [sys.executable, *command(name, full), "--json", str(out / f"{name}.json")]
        print(f"\n## {' '.join(Path(c).name if c.endswith('.py') else c for c in cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        code = subprocess.run(cmd, env=env, cwd=BENCH.parent).returncode
        runs[name] = {"args": cmd[2:-2], "exit_code": code, "seconds": time.perf_counter() - t0}
    return runs


def load(out: Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The JSON results present in `out`, by benchmark name."""
    return {n: json.loads((out / f"{n}.json").read_text()) for n in names if (out / f"{n}.json").is_file()}


# ------------------------------------------------------------------------------------------ sections


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _k(x: float) -> str:
    return f"{x / 1e3:,.1f} k"


def write_section(data: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Upsert throughput (median run per configuration) and single-row latency; chart data."""
    groups: dict[tuple[bool, int], dict[str, list[float]]] = {}
    for r in data["throughput"]:
        groups.setdefault((r["durable"], r["regions"]), {}).setdefault(r["engine"], []).append(
            r["rows_per_s"]
        )
    engines = list(dict.fromkeys(r["engine"] for r in data["throughput"]))
    rows, chart = [], {"groups": [], "series": {e: [] for e in engines}}
    for (durable, regions), by_engine in groups.items():
        rates = {e: statistics.median(v) for e, v in by_engine.items()}
        label = f"{'durable' if durable else 'non-durable'}, {regions} region{'s' if regions > 1 else ''}"
        ours = rates.get("memwal_df")
        cells = [_k(rates[e]) if e in rates else "-" for e in engines]
        ratios = [
            f"{ours / rates[e]:.2f}x" if ours and e in rates else "-" for e in engines if e != "memwal_df"
        ]
        rows.append([label, *cells, *ratios])
        chart["groups"].append(label)
        for e in engines:
            chart["series"][e].append(rates.get(e, 0.0))
    others = [e for e in engines if e != "memwal_df"]
    lines = ["### Upsert throughput (rows/s, each run ends with everything durable and flushed)", ""]
    lines += _md_table(["configuration", *engines, *(f"memwal_df / {e}" for e in others)], rows)
    lines += ["", "### Single-row latency", ""]
    lat = [[x["name"], x["n"], f"{x['p50_ms']:.3f}", f"{x['p99_ms']:.3f}"] for x in data["latency"]]
    lines += _md_table(["measurement", "n", "p50 ms", "p99 ms"], lat)
    return lines, chart


def _read_ms(r: dict[str, Any]) -> float:
    return r["p50_ms"] if "p50_ms" in r else r["median_s"] * 1e3


def _targets(data: dict[str, Any]) -> list[str]:
    """The run's target verdicts (docs/performance.md) as a Markdown table (none when the JSON has none)."""
    if not data.get("targets"):
        return []
    return ["", "Targets (docs/performance.md), judged on memwal_df SQL:", ""] + _md_table(
        ["target", "measured", "met"],
        [[t["target"], t["measured"], "yes" if t["met"] else "NO"] for t in data["targets"]],
    )


def read_section(data: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Scans and point lookups by engine (median / p50 ms) and the targets; chart data."""
    ops = list(dict.fromkeys(r["op"] for r in data["results"]))
    engines = list(dict.fromkeys(r["engine"] for r in data["results"]))
    by = {(r["op"], r["engine"]): r for r in data["results"]}
    rows = []
    for op in ops:
        cells = []
        for e in engines:
            r = by.get((op, e))
            cells.append(
                "-"
                if r is None
                else f"{_read_ms(r):,.2f}" + (f" / {r['p99_ms']:,.2f}" if "p99_ms" in r else "")
            )
        rows.append([op, *cells])
    lines = ["### Scans and point lookups (ms: median of the runs; lookups p50 / p99)", ""]
    lines += _md_table(["operation", *engines], rows)
    lines += _targets(data)
    for m in data.get("mismatches", []):
        lines.append(f"\nWARNING: memwal_df and Lance's LSM reader disagree: {m}")
    chart = {
        "groups": ops,
        "series": {e: [_read_ms(by[(o, e)]) if (o, e) in by else 0.0 for o in ops] for e in engines},
    }
    return lines, chart


NARROW_ENGINES = {  # engine in the JSON -> its name in the report
    "memwal_df SQL": "memwal_df SQL",
    "plain Lance via DataFusion": "plain Lance",
    "Lance via DataFusion over the merged base": "Lance over the merged base",
}


def narrow_section(data: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Per SQL shape: memwal_df SQL and plain Lance (ms, median) and their ratio, unmerged and merged,
    and Lance over the merged base; the targets."""
    by = {(r["phase"], r["shape"], NARROW_ENGINES[r["engine"]]): r["median_s"] * 1e3 for r in data["results"]}
    shapes = list(dict.fromkeys(r["shape"] for r in data["results"]))
    columns = [
        (p, e) for p in ("unmerged", "merged") for e in NARROW_ENGINES.values() if (p, shapes[0], e) in by
    ]
    rows = []
    for shape in shapes:
        cells = []
        for phase in ("unmerged", "merged"):
            ours, plain = by.get((phase, shape, "memwal_df SQL")), by.get((phase, shape, "plain Lance"))
            cells += (
                [f"{ours:,.1f}", f"{plain:,.1f}", f"{ours / plain:.2f}x"] if ours and plain else ["-"] * 3
            )
        base = by.get(("merged", shape, "Lance over the merged base"))
        rows.append([shape, *cells, "-" if base is None else f"{base:,.1f}"])
    gens = data["config"]["generations"]
    lines = [f"### SQL shapes, {gens} unmerged generations, then merged (ms, median of the rounds)", ""]
    lines += [
        "Plain Lance here holds the same rows as the table (deduplicated), queried through Lance's "
        "DataFusion provider (`lance.FFILanceTableProvider`) in the same SessionContext; after the "
        "merge the base holds them too, in the layout merges leave (many fragments, deletion files).",
        "",
    ]
    heads = [
        f"{who}, {phase}"
        for phase in ("unmerged", "merged")
        for who in ("memwal_df SQL", "plain Lance", "ratio")
    ]
    lines += _md_table(["SQL shape", *heads, "Lance over the merged base"], rows)
    lines += _targets(data)
    for m in data.get("mismatches", []):
        lines.append(f"\nWARNING: memwal_df's answer differs from plain Lance's: {m}")
    series = {f"{e}, {p}": [by.get((p, s, e), 0.0) for s in shapes] for p, e in columns}
    return lines, {"groups": shapes, "series": series}


def search_section(data: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    lines = ["### Vector search (k = 10)", ""]
    vec = data["vector_search"]
    lines += _md_table(
        ["engine", "p50 ms", "p99 ms", "recall@10"],
        [[r["engine"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['recall']:.3f}"] for r in vec],
    )
    lines += ["", "### Full-text search (k = 10)", ""]
    lines += _md_table(
        ["engine", "p50 ms", "p99 ms"],
        [[r["engine"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}"] for r in data["fts"]],
    )
    if data.get("indexed_write"):
        lines += ["", "### Indexed-write throughput (all base indexes maintained, durable)", ""]
        lines += _md_table(
            ["engine", "rows/s (puts)", "rows/s (puts + close)"],
            [
                [r["engine"], f"{r['put_rows_per_s']:,.0f}", f"{r['total_rows_per_s']:,.0f}"]
                for r in data["indexed_write"]
            ],
        )
    if data.get("cold_s"):
        lines += [
            "",
            "Cold first queries: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in data["cold_s"].items()),
        ]
    lines += _targets(data)
    chart = {
        "vector search": {r["engine"]: r["p50_ms"] for r in vec},
        "full-text search": {r["engine"]: r["p50_ms"] for r in data["fts"]},
    }
    return lines, chart


def merge_section(data: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    lines = ["### Merge into the base table (same source table, copies)", ""]
    merges = data["merge"]
    peer = next((m for m in merges if m["engine"].startswith("Lance")), None)
    lines += _md_table(
        ["engine", "rows", "seconds", "rows/s", "speed vs Lance primitives", "same result"],
        [
            [
                m["engine"],
                f"{m['rows']:,}",
                f"{m['seconds']:.2f}",
                _k(m["rows"] / m["seconds"]),
                f"{peer['seconds'] / m['seconds']:.2f}x" if peer else "-",
                "yes" if m["same_result"] else "NO",
            ]
            for m in merges
        ],
    )
    lines += ["", "### Background jobs over many small generations", ""]
    lines += _md_table(
        ["job", "seconds", "ms / generation", "result"],
        [
            [j["job"], f"{j['seconds']:.2f}", f"{j['seconds'] / j['generations'] * 1e3:.2f}", j["what"]]
            for j in data["jobs"]
        ],
    )
    return lines, {m["engine"]: m["rows"] / m["seconds"] for m in merges}


def churn_section(data: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The churn run's own per-kind table, what was written meanwhile and every wrong answer."""
    recall = "-" if data["recall"] is None else f"{data['recall']:.3f}"
    lines = [
        f"{data['rows_written']:,} rows written in {data['writes']:,} writes during the run, "
        f"{len(data['base_commits']) - 1} base commits; exact-check recall@10 {recall}; "
        f"{len(data['failures'])} wrong or failed answers.",
        "",
        data["table"],
    ]
    if data["failures"]:
        lines += ["", "Wrong or failed answers:", ""] + [f"- {f}" for f in data["failures"][:20]]
    return lines, {}


# -------------------------------------------------------------------------------------------- charts


def charts(charts_data: dict[str, Any], out: Path) -> list[str]:
    """PNG charts of the sections present; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def grouped(name: str, title: str, d: dict[str, Any], ylabel: str, log: bool) -> None:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        n = len(d["series"])
        width = 0.8 / max(n, 1)
        for i, (label, values) in enumerate(d["series"].items()):
            xs = [g + (i - (n - 1) / 2) * width for g in range(len(d["groups"]))]
            ax.bar(xs, values, width, label=label)
        ax.set_xticks(range(len(d["groups"])), d["groups"], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    def horizontal(name: str, title: str, values: dict[str, float], xlabel: str) -> None:
        fig, ax = plt.subplots(figsize=(9, 0.5 * len(values) + 1.5))
        ax.barh(list(values), list(values.values()))
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    if "write" in charts_data:
        grouped("write.png", "Upsert throughput (higher is better)", charts_data["write"], "rows/s", False)
    if "read" in charts_data:
        grouped(
            "read.png", "Scans and point lookups (lower is better)", charts_data["read"], "ms (log)", True
        )
    if "narrow" in charts_data:
        title = "Narrow table: SQL shapes against plain Lance (lower is better)"
        grouped("narrow.png", title, charts_data["narrow"], "ms (log)", True)
    for kind, values in charts_data.get("search", {}).items():
        horizontal(f"search-{kind.split()[0]}.png", f"{kind}: p50 latency (lower is better)", values, "ms")
    if "merge" in charts_data:
        horizontal("merge.png", "Merge throughput (higher is better)", charts_data["merge"], "rows/s")
    return written


# -------------------------------------------------------------------------------------------- report

SECTIONS = {
    "write": ("Write path (bench/write.py)", write_section),
    "read": ("Read path (bench/read.py)", read_section),
    "narrow": ("Narrow table against plain Lance (bench/read.py --narrow)", narrow_section),
    "search": ("Search (bench/search.py)", search_section),
    "merge": ("Merge and background jobs (bench/merge.py)", merge_section),
    "churn": ("Reads under churn (bench/churn.py)", churn_section),
}
CHART_OF = {
    "write": ["write.png"],
    "read": ["read.png"],
    "narrow": ["narrow.png"],
    "search": ["search-vector.png", "search-full-text.png"],
    "merge": ["merge.png"],
    "churn": [],
}


def render(
    results: dict[str, dict[str, Any]], runs: dict[str, dict[str, Any]], out: Path, with_charts: bool
) -> str:
    """report.md from the benchmarks' JSON (and the charts next to it when `with_charts`)."""
    lines = [
        "# memwal_df benchmark report",
        "",
        f"Generated {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC by `bench/report.py` on "
        f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f} at the end), Python "
        f"{platform.python_version()}. Engines are compared within this run only; on a shared machine "
        "absolute figures drift by +-20% between runs.",
        "",
        "Peers: **Lance native** = Lance 14's own MemWAL writer and LSM readers (`mem_wal_writer`, "
        "`LsmScanner`, `LsmPointLookupPlanner`, `LsmVectorSearchPlanner`) on the same data; **plain "
        "Lance** = the base table alone through Lance (no newer levels: a floor, not a peer).",
    ]
    chart_data = {}
    for name, (title, section) in SECTIONS.items():
        if name not in results:
            if name in runs:
                lines += ["", f"## {title}", "", f"No results: exit code {runs[name]['exit_code']}."]
            continue
        body, chart_data[name] = section(results[name])
        lines += ["", f"## {title}", ""]
        if name in runs:
            cmd = " ".join([f"bench/{SCRIPT.get(name, name)}.py", *runs[name]["args"]])
            lines += [
                f"`python {cmd}` ({runs[name]['seconds']:.0f} s, exit code {runs[name]['exit_code']})",
                "",
            ]
        lines += body
    written = charts(chart_data, out) if with_charts else []
    for name in SECTIONS:
        shown = [c for c in CHART_OF[name] if c in written]
        if shown:
            title = SECTIONS[name][0]
            at = lines.index(f"## {title}") + 2
            lines[at:at] = [f"![{c}]({c})" for c in shown] + [""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--full", action="store_true", help="the reference workload instead of quick sizes")
    p.add_argument("--only", help=f"comma-separated benchmarks (default: {','.join(SECTIONS)})")
    p.add_argument("--out", type=Path, default=RESULTS, help="where JSON, report.md and charts go")
    p.add_argument("--no-run", action="store_true", help="only render the report from existing JSON")
    p.add_argument("--no-charts", action="store_true", help="skip the PNG charts (no matplotlib needed)")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(SECTIONS)
    unknown = set(names) - set(SECTIONS)
    if unknown:
        p.error(f"unknown benchmarks {sorted(unknown)}; choose from {list(SECTIONS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {} if args.no_run else run_benches(names, args.full, args.out)
    if not args.no_run:
        for n in names:  # a failed run must not leave an older JSON to be reported as this run's
            if runs[n]["exit_code"] != 0:
                (args.out / f"{n}.json").unlink(missing_ok=True)
    report = render(load(args.out, names), runs, args.out, not args.no_charts)
    (args.out / "report.md").write_text(report)
    print(f"\nreport written to {args.out / 'report.md'}")
    return 1 if any(r["exit_code"] for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
