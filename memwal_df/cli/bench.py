"""`memwal bench`: run a benchmark script of the source checkout's `bench/` directory (default:
`report`, which runs the quick benchmarks and writes bench/results/report.md with charts)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = ("report", "write", "read", "search", "merge", "point_lookup", "snapshot_mode")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmarks (default: the report)",
        description="Run bench/NAME.py of a source checkout with the arguments after NAME, e.g. "
        "`memwal bench read --small` or `memwal bench report --full`. Exit code: the script's.",
    )
    p.add_argument("name", nargs="?", default="report", choices=SCRIPTS, help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (see NAME --help)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    script = BENCH_DIR / f"{args.name}.py"
    if not script.is_file():
        raise FileNotFoundError(
            f"{script} not found: the benchmarks come with a source checkout of memwal_df"
        )
    root = str(BENCH_DIR.parent)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
    return subprocess.run([sys.executable, str(script), *args.args], env=env, cwd=root).returncode
