"""`memwal ingest` (upserts from files; `--partial`: column updates) and `memwal delete` (deletes by
key, from files or `--keys`).

Rows go through the table's routed writer (or one region's writer with `--region`) in batches of
`--batch-size` rows, read by a background thread; `close()` at the end makes every write durable and
flushes the MemTables into generations, so readers of the durable levels see all of it when the
command returns. On an error, and on SIGINT (Ctrl-C) or SIGTERM, the command stops reading and closes
the writer the same way, so every acknowledged row is visible; an interrupted run prints what it
acknowledged and exits with 130 (SIGINT) or 143 (SIGTERM). A second signal abandons the flush. If the
flush fails, the error says so: durable writes stay in the WAL, and the maintain loop's next round
(the writer released its lease) or `memwal recover` makes them visible; non-durable ones not yet in
the WAL are lost.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import operator
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.cli import common as c
from memwal_df.cli.inputs import FORMAT_NAMES, STDIN, Progress, format_of, read_batches, total_rows
from memwal_df.errors import InvalidArgumentError, SchemaMismatchError
from memwal_df.format.layout import parse_region_id
from memwal_df.format.schema import TableSchema, conform
from memwal_df.read.dataset import MemWalTable
from memwal_df.table import Table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ingest",
        help="upsert rows from Parquet/CSV/JSON/Arrow files",
        description="Upsert the rows of FILEs (streamed in batches), routed to their regions; with "
        "--delete the files hold keys to delete instead.",
    )
    c.add_table(p)
    p.add_argument(
        "files", nargs="+", metavar="FILE", help="input files; - reads standard input (needs --format)"
    )
    p.add_argument("--delete", action="store_true", help="the files hold keys (extra columns ignored)")
    p.add_argument(
        "--partial",
        action="store_true",
        help="the files hold the primary key and some of the other columns: each row updates only the "
        "columns it carries (a new key gets NULL in the others)",
    )
    _writer_args(p)
    p.set_defaults(run=run_ingest)

    d = sub.add_parser(
        "delete",
        help="delete rows by primary key",
        description="Delete rows by primary key: --keys for a one-column key, or FILEs of key columns.",
    )
    c.add_table(d)
    d.add_argument(
        "files", nargs="*", metavar="FILE", help="files whose key columns name the rows; - is standard input"
    )
    d.add_argument("--keys", help="comma-separated keys (one-column primary keys)")
    _writer_args(d)
    d.set_defaults(run=run_delete, delete=True)


def _writer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMAT_NAMES, help="input format (default: from the extension)")
    p.add_argument("--batch-size", type=int, default=10_000, help="rows per write (default 10,000)")
    p.add_argument(
        "--durable",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wait for each write's WAL entry (default: the table's writer default)",
    )
    p.add_argument(
        "--region",
        help="write to this region id only: any id on a table without a region spec, an existing "
        "region's id on a table with one (new regions there are created by routing)",
    )
    p.add_argument(
        "--allow-non-key-region-columns",
        action="store_true",
        help="write to a table whose region spec (made elsewhere) reads columns outside the primary key; "
        "never change those columns of an existing key",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar on stderr, with the total and ETA when the inputs' row counts are "
        "known (Parquet, Arrow IPC files) (default: when stderr is a terminal and without --json)",
    )
    c.add_json(p)


def run_ingest(args: argparse.Namespace) -> int:
    if args.partial and args.delete:
        raise InvalidArgumentError("--partial updates columns; it cannot be combined with --delete")
    return _run(args, _inputs(args.files))


def run_delete(args: argparse.Namespace) -> int:
    if not args.files and not args.keys:
        raise InvalidArgumentError("give --keys or key FILEs")
    return _run(args, _inputs(args.files))


def _inputs(names: list[str]) -> list[Path | str]:
    """The input files (FileNotFoundError for a missing one) and `-` for standard input (once)."""
    if names.count(STDIN) > 1:
        raise InvalidArgumentError("standard input (-) can be read only once")
    return [STDIN if n == STDIN else c.existing_file(n) for n in names]


def _run(args: argparse.Namespace, files: list[Path | str]) -> int:
    if args.batch_size < 1:
        raise InvalidArgumentError("--batch-size must be at least 1")
    table = c.table_of(args)
    formats = [format_of(f, args.format) for f in files]  # every file's format checked up front
    totals = [total_rows(f, fmt) for f, fmt in zip(files, formats, strict=True)]
    known = None if None in totals else sum(t or 0 for t in totals)
    show = sys.stderr.isatty() and not args.json if args.progress is None else args.progress
    progress = Progress("delete" if args.delete else "ingest", known, show)
    sources: list[Iterable[pa.RecordBatch]] = [
        read_batches(f, fmt, args.batch_size) for f, fmt in zip(files, formats, strict=True)
    ]
    if getattr(args, "keys", None):
        sources.insert(0, [_keys_batch(table, args.keys)])
    partial = getattr(args, "partial", False)  # (`memwal delete` has no --partial)
    t0 = time.perf_counter()
    writer = _writer(table, args)
    pk = table.schema.primary_key
    reader = MemWalTable(table) if args.delete else None
    existing: list[pa.Table] = []  # the given keys the table held, looked up before their delete
    written = False
    with _Signals() as signals:
        try:
            with writer:
                for batch in _prefetched(itertools.chain.from_iterable(sources), signals.received):
                    if reader is not None:
                        keys = _keys_of(batch, pk)
                        existing.append(_existing(reader, keys, table.schema))
                        writer.delete(keys)
                    else:
                        writer.put(batch, partial=partial)
                    progress.update(batch.num_rows)
                put_s = time.perf_counter() - t0
                written = True
        except BaseException as e:
            progress.close()
            if written:  # closing (the flush) failed: say where the acknowledged rows are
                e.add_note(_not_flushed(progress.done, writer.config.durable_write))
            raise
    progress.close()
    total_s = time.perf_counter() - t0
    info = {
        "operation": "delete" if args.delete else "partial upsert" if partial else "upsert",
        "files": [str(f) for f in files],
        "interrupted": signals.name,
        "rows": progress.done,
        **({"keys_existed": _distinct(existing, pk)} if args.delete else {}),
        "regions": _regions(writer),
        "write_s": round(put_s, 3),
        "total_s": round(total_s, 3),
        "rows_per_s": round(progress.done / total_s) if total_s else None,
    }
    c.emit(args, info, lambda: _text(info))
    if signals.name is not None:
        return c.Exit.INTERRUPTED if signals.name == "SIGINT" else c.Exit.TERMINATED
    return c.Exit.OK


class _Signals:
    """SIGINT and SIGTERM while rows are written: the first one is recorded (`received()` turns
    true, the reading stops), so the writer is closed and everything acknowledged made visible; a
    second one raises KeyboardInterrupt, abandoning the flush. Installed in the main thread only."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.name is not None:
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        print(f"{self.name}: stopping; flushing what was written (again: abandon it)", file=sys.stderr)

    def received(self) -> bool:
        return self.name is not None

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _prefetched(batches: Iterable[pa.RecordBatch], stop: Callable[[], bool]) -> Iterator[pa.RecordBatch]:
    """`batches`, read ahead by a daemon thread (a read of standard input may block for as long as
    the input stays quiet), until `stop()` turns true; an error of the reading is raised here."""
    items: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=2)
    done = threading.Event()

    def offer(item: tuple[str, Any]) -> bool:
        while not done.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for batch in batches:
                if not offer(("batch", batch)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the writing thread
            offer(("error", e))
        else:
            offer(("end", None))

    threading.Thread(target=read, name="memwal-ingest-read", daemon=True).start()
    try:
        while not stop():
            try:
                kind, item = items.get(timeout=0.05)
            except queue.Empty:
                continue
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        done.set()


def _not_flushed(rows: int, durable: bool) -> str:
    """What became of `rows` acknowledged rows when the writer's final flush failed."""
    where = (
        "are durable in the WAL"
        if durable
        else "are durable in the WAL as far as their entries were written (non-durable: the rest is lost)"
    )
    return (
        f"the {rows:,} rows acknowledged before {where} but not visible yet: the next round of "
        "`memwal maintain` (the writer released its lease) or `memwal recover URI` makes them visible"
    )


def _existing(reader: MemWalTable, keys: pa.RecordBatch, ts: TableSchema) -> pa.Table:
    """The keys of `keys` the table holds a row for (a point lookup of each key column's values;
    for a composite key, the combinations found are joined back to the given ones)."""
    pk = list(ts.primary_key)
    given = conform(pa.Table.from_batches([keys]), ts.key_schema, what="delete keys")
    given = given.group_by(pk).aggregate([])
    wanted = [pc.field(k).isin(given.column(k)) for k in pk]
    found = reader.to_table(columns=pk, filter=functools.reduce(operator.and_, wanted))
    return found if len(pk) == 1 else found.join(given, pk, join_type="inner")


def _distinct(tables: list[pa.Table], primary_key: tuple[str, ...]) -> int:
    """The number of distinct keys in `tables` (a key given twice is counted once)."""
    if not tables:
        return 0
    return pa.concat_tables(tables).group_by(list(primary_key)).aggregate([]).num_rows


def _keys_of(batch: pa.RecordBatch, primary_key: tuple[str, ...]) -> pa.RecordBatch:
    """The key columns of a batch from a key file (other columns are ignored)."""
    missing = [k for k in primary_key if k not in batch.schema.names]
    if missing:
        raise SchemaMismatchError(f"the key file lacks the primary key columns {missing}")
    return batch.select(list(primary_key))


def _writer(table: Table, args: argparse.Namespace) -> Any:
    if args.region:
        return table.region_writer(
            parse_region_id(args.region, "--region"),
            durable=args.durable,
            allow_non_key_region_columns=args.allow_non_key_region_columns,
        )
    return table.writer(durable=args.durable, allow_non_key_region_columns=args.allow_non_key_region_columns)


def _regions(writer: Any) -> list[str]:
    ids = writer.writers if hasattr(writer, "writers") else [writer.region_id]
    return sorted(str(r) for r in ids)


def _keys_batch(table: Table, keys: str) -> pa.RecordBatch:
    """`--keys 1,2,3` as a batch of the (one-column) primary key."""
    pk = table.schema.primary_key
    if len(pk) != 1:
        raise InvalidArgumentError(
            f"--keys needs a one-column primary key; {list(pk)} is composite: use FILEs"
        )
    field = table.schema.schema.field(pk[0])
    items = [k.strip() for k in keys.split(",") if k.strip()]
    try:
        values = pa.array(items, pa.string()).cast(field.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise InvalidArgumentError(f"--keys: cannot read {items} as {field.type}: {e}") from None
    return pa.RecordBatch.from_arrays([values], names=[pk[0]])


def _text(info: dict[str, Any]) -> str:
    if info["interrupted"]:
        done = _done_text(info)
        return f"interrupted by {info['interrupted']}: {done}; every acknowledged write is durable, visible"
    return _done_text(info)


def _done_text(info: dict[str, Any]) -> str:
    if info["operation"] == "delete":
        what = f"deleted {c.count(info['rows'], 'key')} ({info['keys_existed']:,} existed)"
    else:
        what = f"upserted {c.count(info['rows'], 'row')}"
        what += " (the columns given)" if info["operation"] == "partial upsert" else ""
    files = [f for f in info["files"] if f != STDIN]
    sources = [c.count(len(files), "file")] if files else []
    sources += ["standard input"] if STDIN in info["files"] else []
    source = f" from {' and '.join(sources)}" if sources else ""
    return (
        f"{what}{source} through {c.count(len(info['regions']), 'region')} in {info['total_s']:.2f}s "
        f"({info['rows_per_s'] or 0:,} rows/s; flush and close {info['total_s'] - info['write_s']:.2f}s)"
    )
