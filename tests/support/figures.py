"""Figures of the reliability tests, for `docs/guarantees.md`.

A test calls `record(guarantee, test_id, **counts)` (crash points survived, faults injected, rows
checked, peak RSS ...). Counts of the same (guarantee, test) are summed over the run (parametrized
cases add up), peaks (`peak_*` keys) are maxima. The file is `$MEMWAL_FIGURES`, by default
`build/reliability.json` at the repository root (git-ignored), and holds the figures of one pytest
run: the first record of a run starts it afresh, unless `$MEMWAL_FIGURES_CONTINUE` is set (a
follow-up run adds its tests). `scripts/guarantees.py` turns it into `docs/guarantees.md`
(`make reliability`). Writing is a read-modify-write of one small JSON file: pytest runs tests one
at a time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def path() -> Path:
    return Path(os.environ.get("MEMWAL_FIGURES") or ROOT / "build" / "reliability.json")


_SESSION = f"{os.getpid()}@{time.time():.0f}"  # one pytest run: its first record starts a new file


def record(guarantee: str, test: str, **counts: float) -> None:
    """Add `counts` to the figures of `test` under `guarantee` (the file holds one pytest run)."""
    p = path()
    data = json.loads(p.read_text()) if p.exists() else {}
    if data.get("_run", {}).get("session") != _SESSION:
        if os.environ.get("MEMWAL_FIGURES_CONTINUE") and "_run" in data:  # add a follow-up run's tests
            data["_run"]["session"] = _SESSION
            data["_run"]["follow_ups"] = data["_run"].get("follow_ups", 0) + 1
        else:
            data = {
                "_run": {"session": _SESSION, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            }
    data["_run"]["ended"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    entry = data.setdefault(guarantee, {}).setdefault(test, {"runs": 0})
    entry["runs"] += 1
    for key, value in counts.items():
        if key.startswith("peak_"):
            entry[key] = max(entry.get(key, 0), value)
        else:
            entry[key] = entry.get(key, 0) + value
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(p)


def case_name(request: object) -> str:
    """`file::test` of a pytest request (parametrized cases share it, so their figures add up)."""
    node = request.node  # type: ignore[attr-defined]
    return f"{node.path.name}::{node.originalname}"
