"""`python -m memwal_df ...` is the `memwal` command line (e.g. `python -m memwal_df maintain URI`)."""

from __future__ import annotations

import sys

from memwal_df.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m memwal_df"))
