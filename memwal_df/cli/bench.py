"""`memwal bench`: run a benchmark script of a source checkout's `bench/` directory (default:
`report`, which runs the quick benchmarks and writes bench/results/report.md with charts).

The benchmarks are not part of the installed package: the command finds the `bench/` directory of
the checkout holding the current directory, else of the checkout the package is imported from (an
editable install), and fails with `BenchNotFoundError` when there is none (an installed wheel).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from memwal_df.errors import MemWalError

PACKAGE_CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout root, for a source install
SCRIPTS = ("report", "write", "read", "search", "merge", "churn", "point_lookup", "snapshot_mode")


class BenchNotFoundError(MemWalError, FileNotFoundError):
    """No memwal_df source checkout with a `bench/` directory: neither around the current directory
    nor where the package is imported from (an installed wheel carries no benchmarks)."""


def bench_dir(cwd: Path | None = None) -> Path:
    """The `bench/` directory of a memwal_df source checkout: that of the checkout holding `cwd`
    (default: the current directory; the directory itself or a parent), else that of the checkout
    the package is imported from. Raises BenchNotFoundError when neither has one."""
    start = (cwd or Path.cwd()).resolve()
    for root in (start, *start.parents, PACKAGE_CHECKOUT):
        if (root / "bench" / "report.py").is_file() and (root / "memwal_df").is_dir():
            return root / "bench"
    raise BenchNotFoundError(
        f"no bench/ directory of a memwal_df source checkout in or above {start} nor at "
        f"{PACKAGE_CHECKOUT}: the benchmarks come with a source checkout, run memwal bench inside one"
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmarks of a source checkout (default: the report)",
        description="Run bench/NAME.py of a memwal_df source checkout with the arguments after NAME, "
        "e.g. `memwal bench read --small` or `memwal bench report --full`. The checkout is the one "
        "holding the current directory, else the one the package is imported from; an installed "
        "wheel has no benchmarks: without a checkout the command fails with exit code 3. "
        "Exit code: the script's.",
    )
    p.add_argument("name", nargs="?", default="report", choices=SCRIPTS, help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (see NAME --help)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    bench = bench_dir()
    script = bench / f"{args.name}.py"
    if not script.is_file():
        raise BenchNotFoundError(f"{script} not found in the source checkout")
    root = str(bench.parent)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
    return subprocess.run([sys.executable, str(script), *args.args], env=env, cwd=root).returncode
