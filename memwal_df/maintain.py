"""The background-job loop: merge, MemWAL index build, base index catch-up and GC, round after round.

`maintain(table, interval=...)` runs the four jobs in that order every `interval` seconds until
`stop` is set or `max_rounds` rounds ran. A job that raises is logged (`CommitConflictError`, a lost
race with another job or process, at WARNING; anything else with its traceback at ERROR) and simply
runs again next round: every job is safe to repeat and to race (see their modules). Each round's
results and errors are kept in a `Round`; the newest `history` rounds are returned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from memwal_df import gc as _gc
from memwal_df.errors import CommitConflictError, InvalidConfigError

if TYPE_CHECKING:
    from memwal_df.table import Table

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Round:
    """One round: each job's result (by job name) or its error, and when the round started."""

    number: int
    started: float  # time.time()
    results: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)


def maintain(
    table: Table,
    *,
    interval: float = 60.0,
    stop: threading.Event | None = None,
    max_rounds: int | None = None,
    grace: timedelta = _gc.DEFAULT_GRACE,
    history: int = 100,
) -> list[Round]:
    """Run the background jobs until `stop` is set or after `max_rounds` rounds; the newest
    `history` rounds, oldest first. Raises `InvalidConfigError` for a bad argument."""
    if interval < 0 or (max_rounds is not None and max_rounds < 1) or history < 1:
        raise InvalidConfigError(
            f"need interval >= 0, max_rounds >= 1, history >= 1; got {interval}, {max_rounds}, {history}"
        )
    stop = stop or threading.Event()
    jobs: dict[str, Callable[[], Any]] = {
        "merge": table.merge,
        "build_index": table.build_index,
        "catch_up_indexes": table.catch_up_indexes,
        "gc": lambda: table.gc(grace=grace),
    }
    rounds: deque[Round] = deque(maxlen=history)
    number = 0
    while not stop.is_set():
        number += 1
        rounds.append(run_round(number, jobs))
        if max_rounds is not None and number >= max_rounds:
            break
        stop.wait(interval)
    return list(rounds)


def run_round(number: int, jobs: dict[str, Callable[[], Any]]) -> Round:
    """Run each job once, in order; an error is logged and recorded, and the next job still runs."""
    done = Round(number, time.time())
    for name, job in jobs.items():
        start = time.perf_counter()
        try:
            done.results[name] = job()
        except CommitConflictError as e:
            done.errors[name] = e
            log.warning("round %d: %s lost a race, retrying next round: %s", number, name, e)
        except Exception as e:  # noqa: BLE001 - a long-running service logs and retries every job
            done.errors[name] = e
            log.exception("round %d: %s failed, retrying next round", number, name)
        else:
            log.info(
                "round %d: %s done in %.3fs: %s",
                number,
                name,
                time.perf_counter() - start,
                _summary(done.results[name]),
            )
    return done


def _summary(result: Any) -> str:
    for attr in ("generations", "caught_up", "removed", "version"):
        if hasattr(result, attr):
            return f"{attr}={getattr(result, attr)}"
    return repr(result)
