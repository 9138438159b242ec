"""`python -m memwal_df maintain URI --interval S`: run the background jobs of one table until
interrupted (SIGINT/SIGTERM finish the current round, then exit). A full CLI is a later issue."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from datetime import timedelta

from memwal_df.table import open_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memwal_df")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("maintain", help="merge, build the MemWAL index, catch up indexes, GC; repeat")
    run.add_argument("uri")
    run.add_argument("--interval", type=float, default=60.0, help="seconds between rounds (default 60)")
    run.add_argument("--rounds", type=int, default=None, help="stop after this many rounds")
    run.add_argument("--grace", type=float, default=3600.0, help="GC grace period in seconds")
    run.add_argument(
        "--version-retention",
        type=float,
        default=86400.0,
        help="remove base versions older than this many seconds each round (default 86400)",
    )
    run.add_argument("--keep-versions", type=int, default=None, help="but always keep this many newest")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    rounds = open_table(args.uri).maintain(
        interval=args.interval,
        stop=stop,
        max_rounds=args.rounds,
        grace=timedelta(seconds=args.grace),
        version_retention=timedelta(seconds=args.version_retention),
        keep_versions=args.keep_versions,
    )
    return 1 if rounds and rounds[-1].errors else 0


if __name__ == "__main__":
    sys.exit(main())
