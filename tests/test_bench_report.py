"""bench/report.py renders the benchmarks' own JSON: tiny real runs of bench/write.py, read.py (and its
narrow-schema workload) and merge.py, then the report's figures checked against figures recomputed here
from that JSON; and the narrow workload's answer check catches wrong answers."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from support.benches import load_report

ROOT = Path(__file__).resolve().parent.parent
TINY = {
    "write": ["--base", "400", "--rows", "400", "--batch", "100", "--latency-puts", "3", "--lag-puts", "2"],
    "read": ["--rows", "2000", "--upserts", "1000", "--batch", "100", "--lookups", "4", "--repeat", "1"],
    "narrow": ["--rows", "2000", "--upserts", "400", "--batch", "100", "--repeat", "1"],
    "merge": ["--base", "2000", "--rows", "1000", "--regions", "2", "--gens", "2"]
    + ["--job-regions", "2", "--job-gens", "4"],
}


def run_bench(name: str, args: list[str]) -> subprocess.CompletedProcess:
    """Benchmark `name` with `args` (its script and workload as bench/report.py runs them), as `make
    bench` runs it; fails the test on a non-zero exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    report = load_report()
    script = ROOT / "bench" / f"{report.SCRIPT.get(name, name)}.py"
    cmd = [sys.executable, str(script), *report.WORKLOAD.get(name, []), *args]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    for name, args in TINY.items():
        run_bench(
            name,
            [*args, "--json", str(out / f"{name}.json")] + (["--dir", str(out)] if name != "merge" else []),
        )
    return out


def test_report_figures_come_from_the_json(results):
    assert load_report().main(["--no-run", "--no-charts", "--out", str(results)]) == 0
    report = (results / "report.md").read_text()
    write = json.loads((results / "write.json").read_text())
    rates: dict[tuple[bool, int, str], list[float]] = {}
    for r in write["throughput"]:
        rates.setdefault((r["durable"], r["regions"], r["engine"]), []).append(r["rows"] / r["total_s"])
    for durable in (True, False):
        for regions in (4, 1):
            ours = statistics.median(rates[(durable, regions, "memwal_df")])
            lance = statistics.median(rates[(durable, regions, "lance")])
            label = f"{'durable' if durable else 'non-durable'}, {regions} region{'s' if regions > 1 else ''}"
            row = next(line for line in report.splitlines() if line.startswith(f"| {label} |"))
            assert f"| {ours / 1e3:,.1f} k | {lance / 1e3:,.1f} k |" in row
            assert f"| {ours / lance:.2f}x |" in row
    read = json.loads((results / "read.json").read_text())
    for r in read["results"]:
        if "p50_ms" in r:
            assert f"{r['p50_ms']:,.2f} / {r['p99_ms']:,.2f}" in report
    merge = json.loads((results / "merge.json").read_text())
    peer = next(m for m in merge["merge"] if m["engine"].startswith("Lance"))
    for m in merge["merge"]:
        speed = f"{peer['seconds'] / m['seconds']:.2f}x"
        assert re.search(rf"\| {re.escape(m['engine'])} \| {m['rows']:,} \|.*\| {speed} \| yes \|", report)
    narrow = json.loads((results / "narrow.json").read_text())
    assert narrow["mismatches"] == [] and narrow["config"]["generations"] >= 8
    by = {(r["phase"], r["shape"], r["engine"]): r["median_s"] * 1e3 for r in narrow["results"]}
    for (phase, shape, engine), ours in by.items():
        if engine == "memwal_df SQL":
            plain = by[(phase, shape, "plain Lance via DataFusion")]
            assert f"| {ours:,.1f} | {plain:,.1f} | {ours / plain:.2f}x |" in report
    assert len({shape for _, shape, _ in by}) == 9
    assert {(phase, engine) for phase, _, engine in by} == {
        ("unmerged", "memwal_df SQL"),
        ("unmerged", "plain Lance via DataFusion"),
        ("merged", "memwal_df SQL"),
        ("merged", "plain Lance via DataFusion"),
        ("merged", "Lance via DataFusion over the merged base"),
    }
    assert "## Search" not in report  # no search.json: no section


def test_report_charts(results):
    pytest.importorskip("matplotlib")  # installed by `make bench` (the `bench` extra)
    assert load_report().main(["--no-run", "--out", str(results)]) == 0
    report = (results / "report.md").read_text()
    for png in ("write.png", "read.png", "narrow.png", "merge.png"):
        assert (results / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"![{png}]({png})" in report


def test_search_bench_judges_its_targets_from_its_figures_and_leaves_no_tables(tmp_path):
    tiny = ["--base-rows", "2000", "--upserts", "1000", "--memtable-upserts", "100"]
    tiny += ["--queries", "4", "--warmup", "1", "--partitions", "4"]
    out = tmp_path / "search.json"
    run = run_bench("search", [*tiny, "--dir", str(tmp_path), "--json", str(out)])
    assert [p.name for p in tmp_path.iterdir()] == ["search.json"]  # the run's tables are deleted
    data = json.loads(out.read_text())
    vec = {r["engine"]: r for r in data["vector_search"]}
    fts = {r["engine"]: r for r in data["fts"]}
    ours, native = (r["put_rows_per_s"] for r in data["indexed_write"])
    expected = (
        [
            vec[f"memwal_df SQL{s}"]["p50_ms"] <= 10
            and vec[f"memwal_df SQL{s}"]["recall"] >= vec[f"Lance LsmVectorSearchPlanner{s}"]["recall"]
            for s in ("", " (alone)")
        ]
        + [fts[f"memwal_df SQL{s}"]["p50_ms"] <= 20 for s in ("", " (alone)")]
        + [ours >= native]
    )
    assert [t["met"] for t in data["targets"]] == expected
    section = "\n".join(load_report().search_section(data)[0])
    for t in data["targets"]:
        row = f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'NO'} |"
        assert row in run.stdout and row in section


def test_narrow_answer_check_catches_a_stale_row_a_missing_row_and_a_row_not_in_the_table():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from _narrow import Shape, make_data, mismatch
    finally:
        sys.path.remove(str(ROOT / "bench"))
    data = make_data(rows=50, upserts=10, batch=5)
    model = data.model
    updated = next(k for b in data.upserts for k in b.column("id").to_pylist() if k < 50)
    stale = model.set_column(
        2,
        "value",
        pa.array(
            np.where(
                np.arange(model.num_rows) == updated,
                data.base.column("value").to_numpy()[updated],
                model.column("value").to_numpy(),
            )
        ),
    )
    every, limit = Shape("all", "SELECT * FROM {t}"), Shape("any", "SELECT * FROM {t} LIMIT 3", ordered=False)
    assert mismatch(every, model.take(list(range(model.num_rows))[::-1]), model, model) is None
    assert mismatch(every, stale, model, model) is not None
    assert mismatch(every, model.slice(1), model, model) is not None
    three = model.slice(0, 3)
    assert mismatch(limit, model.take([updated, 7, 40]), three, model) is None
    assert mismatch(limit, stale.take([updated, 7, 40]), three, model) is not None
    beyond = pa.table({"id": pa.array([model.num_rows], pa.int64()), "category": ["c1"], "value": [0.5]})
    assert (
        mismatch(limit, pa.concat_tables([model.slice(0, 2), beyond.cast(model.schema)]), three, model)
        is not None
    )
