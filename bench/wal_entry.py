"""WAL entry benchmark: what encoding and decoding one WAL entry costs, and a durable one-row put.

* entry: `encode_entry` then `decode_entry` of one entry of the reference workload's rows (id,
  category, value, text of 5-15 words, vec float32x64; docs/performance.md) for each `--rows` size
  (default 1, 1,000 and 100,000), the median of `--runs` runs (`--big-runs` for entries of 10,000
  rows and more);
* put: `put` of one row through a durable region writer on a local table (each put publishes one
  WAL entry and syncs it), the median of `--puts` puts.

`--baseline FILE` times another version of `memwal_df/format/wal.py` in the same run (e.g. one
written by `git show REV:memwal_df/format/wal.py > FILE`), taking turns with the current one (which
of them goes first alternates run by run); its puts go through the same writer with its
`encode_entry`. Figures are time.perf_counter medians. No timing is asserted: the script reports.

    python bench/wal_entry.py
    python bench/wal_entry.py --baseline /tmp/wal_baseline.py --json bench/results/wal_entry.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
from _workload import SCHEMA, git_state, make_rows, make_vocab, run_in_scratch

import memwal_df as mw
import memwal_df.format.wal as current
import memwal_df.write.wal_commit as wal_commit
from memwal_df.format.regions.spec import lance_field_ids
from memwal_df.format.rows import wal_schema


def load_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("wal_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def ordered(modules: dict[str, ModuleType], run: int) -> list[tuple[str, ModuleType]]:
    """The modules in turn, first one first on even runs and last one first on odd runs."""
    items = list(modules.items())
    return items if run % 2 == 0 else items[::-1]


def entry_batch(n: int) -> pa.RecordBatch:
    rng = np.random.default_rng(42)
    table = make_rows(rng, np.arange(n), make_vocab(rng))
    ws = wal_schema(SCHEMA, lance_field_ids(SCHEMA))
    columns = [c.combine_chunks() for c in table.columns]
    return pa.RecordBatch.from_arrays([*columns, pa.array(np.zeros(n, bool))], schema=ws)


def time_entries(modules: dict[str, ModuleType], n: int, runs: int) -> dict[str, dict[str, float]]:
    batch = entry_batch(n)
    times: dict[str, dict[str, list[float]]] = {k: {"encode": [], "decode": []} for k in modules}
    for run in range(runs):
        for name, module in ordered(modules, run):
            t0 = time.perf_counter()
            data = module.encode_entry([batch], 1, 1)
            t1 = time.perf_counter()
            entry = module.decode_entry(data, 1, "p")
            t2 = time.perf_counter()
            assert entry.num_rows == n
            times[name]["encode"].append(t1 - t0)
            times[name]["decode"].append(t2 - t1)
            times[name].setdefault("bytes", []).append(len(data))
    out = {}
    for name, t in times.items():
        out[name] = {
            "encode_us": statistics.median(t["encode"]) * 1e6,
            "decode_us": statistics.median(t["decode"]) * 1e6,
            "total_us": statistics.median(a + b for a, b in zip(t["encode"], t["decode"], strict=True)) * 1e6,
            "bytes": t["bytes"][0],
        }
    return out


def time_puts(modules: dict[str, ModuleType], puts: int, root: Path) -> dict[str, float]:
    base = entry_batch(10)
    table = mw.create_table(
        str(root / "t"), pa.Table.from_batches([base]).drop_columns(["_tombstone"]), "id", region_spec=None
    )
    one = pa.Table.from_batches([entry_batch(1)]).drop_columns(["_tombstone"])
    writer = table.region_writer(uuid.uuid4(), durable=True)
    times: dict[str, list[float]] = {k: [] for k in modules}
    try:
        for run in range(puts):
            for name, module in ordered(modules, run):
                wal_commit.encode_entry = module.encode_entry  # type: ignore[attr-defined]
                t0 = time.perf_counter()
                writer.put(one)
                times[name].append(time.perf_counter() - t0)
    finally:
        wal_commit.encode_entry = current.encode_entry  # type: ignore[attr-defined]
        writer.close()
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 1_000, 100_000])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--big-runs", type=int, default=30)
    parser.add_argument("--puts", type=int, default=500)
    parser.add_argument("--baseline", help="another version of memwal_df/format/wal.py to time")
    parser.add_argument("--dir", help="where the put's table goes (default: bench/results/)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    modules = {"current": current}
    if args.baseline:
        modules = {"baseline": load_module(args.baseline), "current": current}

    result: dict[str, Any] = {"git": git_state(), "entries": {}, "put_us": {}}
    for n in args.rows:
        runs = args.big_runs if n >= 10_000 else args.runs
        result["entries"][n] = figures = time_entries(modules, n, runs)
        for name, f in figures.items():
            print(
                f"{n:>7} rows {name:>8}: encode {f['encode_us']:9.1f} us  decode {f['decode_us']:9.1f} us  "
                f"encode+decode {f['total_us']:9.1f} us  ({f['bytes']:,} bytes, median of {runs})"
            )

    def puts(args: Any, root: Path) -> int:
        result["put_us"] = time_puts(modules, args.puts, root)
        return 0

    run_in_scratch(args, "wal_entry_", puts)
    for name, us in result["put_us"].items():
        print(f"durable 1-row put {name:>8}: {us:9.1f} us  (median of {args.puts})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
