"""Index upkeep: how an index catch-up calls Lance's `optimize_indices`, so each base index stays a
bounded number of segments and a vector index stays trained on the data it holds.

Each `optimize_indices` that adds merged fragments to an index writes a delta segment (vector
indexes) that every search then probes. `plan` keeps that bounded:
- **segments**: when the index already has `max_segments` segments, the optimize merges all of them
  with the new fragments into one (`num_indices_to_merge`); an index with more segments than that
  is consolidated even when it covers every fragment;
- **retraining** (vector indexes only, and only when `retrain_share` is set: IVF centroids and PQ
  codebooks are trained once and new rows are only assigned to them): once the rows assigned since
  the last training pass `retrain_share` of the rows it was trained on, the optimize retrains
  (`retrain=True`, one segment). Off by default: a retrain trains the index again over every row
  and holds up the maintain round it runs in for as long (docs/background-jobs.md has the figures).

The rows trained on and assigned since are kept per index in `_mem_wal/_index_upkeep.json`
(memwal_df's own file, which Lance ignores). An index first seen there counts as trained on the
rows it holds. Two upkeep runs racing may each miss the other's count; the worst outcome is a
retrain one round early or late.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from memwal_df.errors import InvalidConfigError, NotFoundError
from memwal_df.format.storage import Storage

RECORD_PATH = "_mem_wal/_index_upkeep.json"
_VECTOR = "VectorIndexDetails"


@dataclass(frozen=True)
class IndexUpkeepSettings:
    """Bounds of index upkeep (defaults in the field comments)."""

    max_segments: int = 4  # merge an index's segments into one when it would have more
    retrain_share: float | None = (
        None  # retrain a vector index once rows assigned since training pass this share
    )

    def __post_init__(self) -> None:
        if self.max_segments < 1 or (self.retrain_share is not None and self.retrain_share <= 0):
            raise InvalidConfigError(
                f"need max_segments >= 1 and retrain_share > 0, got {self.max_segments}, {self.retrain_share}"
            )


@dataclass(frozen=True)
class Plan:
    """One index's optimize: Lance's keyword arguments and what it does."""

    kwargs: dict[str, Any]
    merges_segments: bool
    retrains: bool


def is_vector(description: Any) -> bool:
    """Whether a `describe_indices()` entry is a vector index."""
    return _VECTOR in str(description.type_url)


def plan(description: Any, new_rows: int, record: dict[str, int], settings: IndexUpkeepSettings) -> Plan:
    """The optimize of index `description` (from `describe_indices()`) that adds `new_rows` rows:
    a retrain, a merge of every segment, or a plain delta (see the module docstring)."""
    segments = len(description.segments)
    if settings.retrain_share is not None and is_vector(description):
        trained = record.get("trained_rows") or description.num_rows_indexed or 0
        assigned = record.get("assigned_rows", 0) + new_rows
        if trained and assigned > settings.retrain_share * trained:
            return Plan({"retrain": True}, segments > 1, True)
    if segments > settings.max_segments or (new_rows and segments >= settings.max_segments):
        return Plan({"num_indices_to_merge": segments}, True, False)
    return Plan({}, False, False)


def read_records(storage: Storage) -> dict[str, dict[str, int]]:
    """Index name -> {trained_rows, assigned_rows}; empty when none was written (or it is unreadable:
    the counts only time retraining)."""
    try:
        found = json.loads(storage.get(RECORD_PATH))
    except (NotFoundError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def write_records(storage: Storage, records: dict[str, dict[str, int]]) -> None:
    storage.put(RECORD_PATH, json.dumps(records, sort_keys=True).encode())


def updated(
    record: dict[str, int], description: Any, new_rows: int, done: Plan, rows_after: int
) -> dict[str, int]:
    """The record of an index after `done` ran on it; `rows_after`: rows it indexes afterwards."""
    if done.retrains:
        return {"trained_rows": rows_after, "assigned_rows": 0}
    trained = record.get("trained_rows") or description.num_rows_indexed or rows_after
    return {"trained_rows": trained, "assigned_rows": record.get("assigned_rows", 0) + new_rows}
