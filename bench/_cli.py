"""Argument handling and the end of a report, shared by the bench scripts.

* `add_int_args(ap, base_rows=1_000_000, ...)`: integer options with defaults (`--base-rows`).
* `add_table_args(ap, ...)`: `--dir` (where the tables go), `--json` (the report as JSON), `--keep`.
* `config_of(args)`: the arguments as a report's `config`, without the output options.
* `run_environment()`: versions, CPUs, load average and git state, for a report's `config`.
* `print_checks(...)`, `print_failures(...)`, `print_total(...)`: the answer checks and the total time line
  that end a report.
* `write_json(path, data)`: the report as JSON, and where it went.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import datafusion
import lance
import pyarrow as pa
from _workload import git_state


def add_int_args(ap: argparse.ArgumentParser, **defaults: int) -> None:
    """One integer option per keyword, in order: `base_rows=1_000_000` adds `--base-rows`."""
    for name, default in defaults.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def add_table_args(
    ap: argparse.ArgumentParser, dir_help: str = "where the table goes", keep_help: str = "keep the table"
) -> None:
    """--dir (default bench/results/), --json and --keep (default: the tables are deleted at the end)."""
    ap.add_argument("--dir", help=f"{dir_help} (default bench/results/)")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument("--keep", action="store_true", help=f"{keep_help} (default: deleted at the end)")


def config_of(args: argparse.Namespace, leave_out: tuple[str, ...] = ("json", "dir")) -> dict[str, Any]:
    """The run's arguments, without those that only say where its output goes."""
    return {k: v for k, v in vars(args).items() if k not in leave_out}


def run_environment() -> dict[str, Any]:
    """Python, pylance, datafusion and pyarrow versions, CPUs, the load average now and the git state."""
    return {
        "python": platform.python_version(),
        "pylance": lance.__version__,
        "datafusion": datafusion.__version__,
        "pyarrow": pa.__version__,
        "cpus": os.cpu_count(),
        "load_average_end": os.getloadavg()[0],
        "git": git_state(),
    }


def print_checks(mismatches: list[str], differs: str, agreed: str) -> None:
    """A warning per mismatch (`WARNING: <differs>: <mismatch>`), or `agreed` when there is none."""
    for line in mismatches:
        print(f"WARNING: {differs}: {line}")
    if not mismatches:
        print(f"\n{agreed}")


def print_failures(failures: list[str], most: int = 50) -> None:
    """How many answers were wrong or failed, and the first `most` of them."""
    print(f"\n{len(failures)} wrong or failed answers" + (":" if failures else ""))
    for f in failures[:most]:
        print(f"  {f}")


def print_total(t_start: float, note: str = "") -> float:
    """The line that ends a report: seconds since `t_start` (returned) and the load average now."""
    total = time.perf_counter() - t_start
    load = os.getloadavg()[0]
    print(f"\nTotal bench time {total:.0f}s; load average now {load:.1f} on {os.cpu_count()} CPUs{note}.")
    return total


def write_json(path: str, data: Any) -> None:
    """`data` as indented JSON at `path` (its directory made if need be); says where."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2))
    print(f"results written to {path}")
