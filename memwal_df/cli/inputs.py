"""Input files of `memwal ingest` / `memwal delete`, streamed in record batches, and a progress bar.

Formats by extension (or `--format`): Parquet (`.parquet`, `.pq`), CSV (`.csv`), JSON lines (`.json`,
`.jsonl`, `.ndjson`), Arrow IPC files (`.arrow`, `.feather`, `.ipc`) and Arrow IPC streams
(`.arrows`). Files are read through `pyarrow.dataset` (the IPC stream format through
`pyarrow.ipc`), so only a batch at a time is in memory. An empty CSV or JSON file has no rows.
`-` is standard input (its format given with `--format`): CSV, JSON lines and Arrow IPC streams are
streamed from it; Parquet and Arrow IPC files need random access, so they are read whole first.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO, cast

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.dataset as pds
import pyarrow.json as pjson
import pyarrow.parquet as pq

from memwal_df.errors import InvalidArgumentError

FORMATS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".arrow": "ipc",
    ".feather": "ipc",
    ".ipc": "ipc",
    ".arrows": "arrows",
}
FORMAT_NAMES = sorted(set(FORMATS.values()))
STDIN = "-"  # the input name of standard input


def format_of(path: Path | str, given: str | None) -> str:
    """The format of `path`: `given`, else from its extension; InvalidArgumentError if unknown
    (standard input, `-`, has no extension: it needs `given`)."""
    if path == STDIN and given is None:
        raise InvalidArgumentError("reading standard input (-) needs --format")
    fmt = given or FORMATS.get(Path(path).suffix.lower())
    if fmt not in FORMAT_NAMES:
        raise InvalidArgumentError(
            f"cannot tell the format of {path} (extensions: {', '.join(sorted(FORMATS))}); pass --format"
        )
    return fmt


def total_rows(path: Path | str, fmt: str) -> int | None:
    """Row count when the file's metadata has it (Parquet, Arrow IPC file), else None (also for
    standard input)."""
    if path != STDIN and fmt in ("parquet", "ipc"):
        return pds.dataset(path, format=fmt).count_rows()
    return None


def read_batches(path: Path | str, fmt: str, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The input's rows in batches of at most `batch_rows` rows (small batches combined); `-` reads
    standard input."""
    if path == STDIN:
        stdin = cast(io.BufferedReader, sys.stdin.buffer)  # typed BinaryIO; a buffered reader (it peeks)
        yield from rebatch(_stream_batches(stdin, fmt), batch_rows)
    elif fmt == "arrows":
        with pa.OSFile(str(path)) as f:
            yield from rebatch(pa.ipc.open_stream(f), batch_rows)
    elif fmt in ("csv", "json") and _blank(Path(path)):
        return
    else:
        yield from rebatch(pds.dataset(path, format=fmt).to_batches(batch_size=batch_rows), batch_rows)


def _blank(path: Path, chunk: int = 1 << 16) -> bool:
    """Whether a text file holds only whitespace (reads up to its first other byte)."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if block.strip():
                return False
    return True


def _stream_batches(stream: io.BufferedReader, fmt: str) -> Iterator[pa.RecordBatch]:
    """The batches of a non-seekable input in `fmt` (empty input: none)."""
    if fmt in ("parquet", "ipc"):  # need random access: read it whole
        data = pa.BufferReader(stream.read())
        if data.size() == 0:
            return
        if fmt == "parquet":
            yield from pq.ParquetFile(data).iter_batches()
        else:
            reader = pa.ipc.open_file(data)
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
        return
    if not stream.peek(1):
        return
    source = pa.PythonFile(stream, mode="r")
    if fmt == "arrows":
        yield from pa.ipc.open_stream(source)
    elif fmt == "csv":
        yield from pcsv.open_csv(source)
    else:
        yield from pjson.open_json(source)


def read_all(path: Path, fmt: str) -> pa.Table:
    """The whole file as one table (its schema even when it has no rows)."""
    if fmt == "arrows":
        with pa.OSFile(str(path)) as f:
            return pa.ipc.open_stream(f).read_all()
    return pds.dataset(path, format=fmt).to_table()


def rebatch(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """Batches of `rows` rows (the last may be shorter) from batches of any size."""
    pending: list[pa.RecordBatch] = []
    have = 0
    for b in batches:
        pending.append(b)
        have += b.num_rows
        while have >= rows:
            merged = pa.Table.from_batches(pending).combine_chunks()
            yield merged.slice(0, rows).to_batches(max_chunksize=rows)[0]
            rest = merged.slice(rows)
            pending, have = rest.to_batches(), rest.num_rows
    if have:
        yield pa.Table.from_batches(pending).combine_chunks().to_batches(max_chunksize=have)[0]


class Progress:
    """A one-line progress bar on a terminal (rows done, of the total when known, rows/s)."""

    def __init__(self, label: str, total: int | None, enabled: bool, out: TextIO | None = None) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.out = out or sys.stderr
        self.done = 0
        self.start = self._shown = time.perf_counter()

    def update(self, rows: int) -> None:
        self.done += rows
        now = time.perf_counter()
        if self.enabled and now - self._shown >= 0.1:
            self._shown = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.out.write("\n")
            self.out.flush()

    def _draw(self, now: float) -> None:
        rate = self.done / max(now - self.start, 1e-9)
        tail = ""
        if self.total:
            share = min(self.done / self.total, 1.0)
            bar = "#" * int(share * 30)
            head = f"[{bar:<30}] {share:4.0%} {self.done:,}/{self.total:,}"
            if self.done < self.total:
                tail = f", ETA {_clock((self.total - self.done) / rate) if rate else '?'}"
        else:
            head = f"{self.done:,}"
        self.out.write(f"\r{self.label}: {head} rows, {rate:,.0f} rows/s{tail}\x1b[K")
        self.out.flush()


def _clock(seconds: float) -> str:
    """A duration as `m:ss` (`h:mm:ss` from an hour)."""
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"
