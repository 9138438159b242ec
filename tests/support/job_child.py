"""A child process for crash tests of the background jobs and of writers (`test_crash_jobs.py`,
`test_load.py`): `python job_child.py MODE URI OPTIONS_JSON [ARGS_JSON]`.

Modes:
* `merge` / `gc` / `build` / `compact` / `maintain`: one run of the job (`gc` first cleans up base
  versions older than now, so that merged generations become removable; `compact` and `maintain`'s
  round compact with `ARGS["compaction"]`, the fields of `CompactionSettings`); with
  `ARGS["crash"] = [point, k]` the process ends with `os._exit(9)` the k-th time it reaches `point`
  (our own code or a Lance call wrapped in this process; storage stays real). Exit 0 when the job
  finished without reaching it. With `ARGS["announce"]` it prints `compacting` when it calls Lance's
  `compact_files`, so that the parent can time a SIGKILL inside Lance's rewrite.
* `jobs`: merge, index build, index catch-up, version cleanup and GC, round after round, until killed;
  cleanup keeps base versions younger than `ARGS["retain_s"]` (default 0), the time-travel retention
  concurrent readers need (a reader of a version cleaned up meanwhile fails in Lance).
* `write`: a routed durable writer streaming random puts and deletes (seeded) until killed or
  `ARGS["n"]` ops; each op is logged to `ARGS["log"]` before the call (`intent`) and after it returns
  (`ack`), every line flushed and fsynced, so the parent knows exactly what was acknowledged.

It prints `ready` once the table is open (the parent times its SIGKILL from there).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from datetime import timedelta
from typing import Any

import lance
import pyarrow as pa
from lance.dataset import DatasetOptimizer, MergeInsertBuilder

import memwal_df as mw
from memwal_df.format import memwal_index
from memwal_df.format.local_storage import LocalStorage
from memwal_df.format.object_storage import ObjectStorage
from memwal_df.jobs import index_builder
from memwal_df.jobs.compaction import CompactionSettings

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.float64())])
ZERO = timedelta(0)


def inject(point: str, k: int) -> None:
    """Wrap the function at `point` so that its k-th hit ends the process."""
    hits = [0]

    def hit() -> None:
        hits[0] += 1
        if hits[0] == k:
            os._exit(9)

    def after(owner: Any, name: str, when: Any = lambda result, *a: True) -> None:
        real = getattr(owner, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            result = real(*a, **kw)
            if when(result, *a):
                hit()
            return result

        setattr(owner, name, wrapped)

    def before(owner: Any, name: str, when: Any = lambda *a: True) -> None:
        real = getattr(owner, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            if when(*a):
                hit()
            return real(*a, **kw)

        setattr(owner, name, wrapped)

    if point == "merge_after_delete":  # pass 1 (tombstones) committed, pass 2 (upserts + marker) not
        after(MergeInsertBuilder, "execute", lambda r, builder, *a: not _is_upsert(builder))
    elif point == "merge_before_upsert":  # about to run pass 2's merge_insert
        before(MergeInsertBuilder, "execute", lambda builder, *a: _is_upsert(builder))
    elif point == "merge_after_upsert":  # pass 2 committed, the merger never reported it
        after(MergeInsertBuilder, "execute", lambda r, builder, *a: _is_upsert(builder))
    elif point == "gc_after_unlist":  # merged generations dropped from a manifest, directories kept
        from memwal_df.jobs import garbage as gc

        after(gc, "_unlist", lambda m, store, floor: m is not None and floor > 0)
    elif point == "gc_mid_delete":  # inside a generation directory's deletion, file by file
        before(os, "unlink")
        before(ObjectStorage, "delete", lambda self, path: "_gen_" in path)
        ObjectStorage.delete_prefix = _one_by_one  # type: ignore[method-assign]  # patched in this child only
    elif point == "gc_mid_wal":  # between two WAL entry deletions
        for cls in (LocalStorage, ObjectStorage):
            after(cls, "delete", lambda r, self, path: "/wal/" in path)
    elif point == "build_after_last_seen":  # the builder advanced a region's wal_entry_position_last_seen
        after(index_builder, "_region_state", lambda state, *a: state[1])
    elif point == "build_before_commit":
        before(memwal_index, "replace_details")
    elif point == "build_after_commit":
        after(memwal_index, "replace_details")
    elif point == "compact_before_rewrite":  # the compaction planned, Lance's rewrite not started
        before(DatasetOptimizer, "compact_files")
    elif point == "compact_after_commit":  # Lance's rewrite committed, the catch-up not yet restored
        after(DatasetOptimizer, "compact_files")
    else:
        raise SystemExit(f"unknown crash point {point}")


def _is_upsert(builder: Any) -> bool:
    """Pass 2 is the merge_insert that marks generations as compacted (pass 1 sets no marker)."""
    return bool(getattr(builder, "_memwal_upsert", False))


def _mark(real: Any) -> Any:
    def mark(self: Any, *a: Any, **kw: Any) -> Any:
        self._memwal_upsert = True
        return real(self, *a, **kw)

    return mark


MergeInsertBuilder.mark_sstables_as_compacted = _mark(  # type: ignore[method-assign]  # the child's probe
    MergeInsertBuilder.mark_sstables_as_compacted
)


def _one_by_one(self: Any, prefix: str) -> int:
    """ObjectStorage.delete_prefix as single DELETEs, so a crash can land between two of them."""
    paths = self.list(prefix)
    for path in paths:
        self.delete(path)
    return len(paths)


def announce() -> None:
    """Print `compacting` when Lance's compaction starts (the parent watches for its data files)."""
    real = DatasetOptimizer.compact_files

    def compact_files(self: Any, *a: Any, **kw: Any) -> Any:
        print("compacting", flush=True)
        return real(self, *a, **kw)

    DatasetOptimizer.compact_files = compact_files  # type: ignore[method-assign]  # the child's probe


def run_job(
    table: mw.Table,
    mode: str,
    uri: str,
    options: dict[str, str] | None,
    retain: timedelta = ZERO,
    args: dict[str, Any] | None = None,
) -> None:
    settings = CompactionSettings(**(args or {}).get("compaction", {}))
    if mode == "merge":
        table.merge()
    elif mode == "build":
        table.build_index()
        table.catch_up_indexes()
    elif mode == "gc":
        lance.dataset(uri, storage_options=options).cleanup_old_versions(older_than=retain)
        table.gc(grace=ZERO, keep_manifest_versions=2)
    elif mode == "compact":
        table.compact(settings)
    elif mode == "maintain":
        (done,) = table.maintain(
            interval=0, max_rounds=1, grace=ZERO, version_retention=ZERO, compact=settings
        )
        if done.errors:
            raise SystemExit(f"maintain round failed: {done.errors}")
    else:
        raise SystemExit(f"unknown job {mode}")


def jobs_forever(table: mw.Table, uri: str, options: dict[str, str] | None, retain: timedelta) -> None:
    while True:
        for mode in ("merge", "build", "gc"):
            try:
                run_job(table, mode, uri, options, retain)
            except mw.errors.MemWalError as e:  # a lost race with the writer's claims: next round
                print(f"{mode}: {type(e).__name__}: {e}", file=sys.stderr)


def log_line(f: Any, msg: dict[str, Any]) -> None:
    f.write(json.dumps(msg) + "\n")
    f.flush()
    os.fsync(f.fileno())


def write_stream(table: mw.Table, args: dict[str, Any]) -> None:
    """Random durable puts and deletes of `ARGS["key_list"]` (or keys below `ARGS["keys"]`) for
    `ARGS["n"]` ops or `ARGS["seconds"]`, then close the writer (everything flushed)."""
    rng = random.Random(args["seed"])
    keys = args.get("key_list") or list(range(args["keys"]))
    max_rows = min(args.get("max_rows", 6), len(keys))
    deadline = time.monotonic() + args.get("seconds", float("inf"))
    with open(args["log"], "a") as log, table.writer(durable=True, **args.get("settings", {})) as w:
        for i in range(args.get("n", 10**9)):
            if time.monotonic() > deadline:
                break
            tag = float(args["seed"] * 10**7 + i)
            if rng.random() < 0.2:
                op = {"op": "delete", "keys": sorted(rng.sample(keys, rng.randint(1, min(4, max_rows))))}
            else:
                op = {
                    "op": "put",
                    "rows": [[k, tag] for k in sorted(rng.sample(keys, rng.randint(1, max_rows)))],
                }
            log_line(log, {"intent": i, **op})
            if op["op"] == "put":
                ids, values = zip(*op["rows"], strict=True)
                w.put(pa.table({"id": pa.array(ids, pa.int64()), "v": pa.array(values, pa.float64())}))
            else:
                w.delete(op["keys"])
            log_line(log, {"ack": i})


def main() -> None:
    mode, uri = sys.argv[1], sys.argv[2]
    options = json.loads(sys.argv[3]) or None
    args = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    table = mw.open_table(uri, options)
    if "crash" in args:
        inject(*args["crash"])
    if args.get("announce"):
        announce()
    print("ready", flush=True)
    if mode == "jobs":
        jobs_forever(table, uri, options, timedelta(seconds=args.get("retain_s", 0)))
    elif mode == "write":
        write_stream(table, args)
    else:
        run_job(table, mode, uri, options, args=args)


if __name__ == "__main__":
    main()
