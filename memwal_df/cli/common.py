"""What every `memwal` command shares: table arguments, storage options, output (text or `--json`),
plain-text tables, and the mapping from errors to exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import json
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from memwal_df import errors
from memwal_df.table import Table, open_table


class Exit(enum.IntEnum):
    """Exit codes of `memwal` (documented in docs/operations.md)."""

    OK = 0
    FAILED = 1  # a job or check failed (maintain round errors, bench failure, corrupt data)
    USAGE = 2  # bad arguments or input data (argparse errors too)
    NOT_FOUND = 3  # no table / no input file, or a table already exists where one is created
    CONFLICT = 4  # lost a race or was fenced: running the command again may succeed
    STORAGE = 5  # the object store or file system failed
    SQL = 6  # DataFusion rejected or failed the SQL
    INTERRUPTED = 130  # Ctrl-C
    TERMINATED = 143  # SIGTERM (memwal ingest / delete)


class SqlError(Exception):
    """A query DataFusion rejected or failed (its message, without the Python traceback it wraps).
    `kind` names the memwal_df error it carries (`SqlError` for DataFusion's own errors), `message`
    is that error's message; the text is `kind: message` for a memwal_df error."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(f"{kind}: {message}" if kind else message)
        self.kind = kind or type(self).__name__
        self.message = message


def error_document(exc: BaseException) -> dict[str, Any]:
    """The JSON document `--json` prints for a failed command: `{"error": {"type", "message"}}`."""
    if isinstance(exc, SqlError):
        return {"error": {"type": exc.kind, "message": exc.message}}
    notes = "".join(f"\n{n}" for n in getattr(exc, "__notes__", ()))
    return {"error": {"type": type(exc).__name__, "message": f"{exc}{notes}"}}


# First match wins: subclasses before their bases.
_EXIT_CODES: tuple[tuple[type[BaseException], Exit], ...] = (
    (errors.TableNotFoundError, Exit.NOT_FOUND),
    (errors.TableExistsError, Exit.NOT_FOUND),
    (FileNotFoundError, Exit.NOT_FOUND),
    (errors.CommitConflictError, Exit.CONFLICT),
    (errors.WriterFencedError, Exit.CONFLICT),
    (errors.BackpressureTimeoutError, Exit.CONFLICT),
    (errors.StorageError, Exit.STORAGE),
    (errors.MissingGenerationError, Exit.STORAGE),
    (SqlError, Exit.SQL),
    (errors.InvalidArgumentError, Exit.USAGE),
    (errors.SchemaMismatchError, Exit.USAGE),
    (errors.NullPrimaryKeyError, Exit.USAGE),
    (errors.RegionRoutingError, Exit.USAGE),
    (errors.InvalidRegionSpecError, Exit.USAGE),
    (errors.InvalidConfigError, Exit.USAGE),
    (errors.RepairRefusedError, Exit.USAGE),
    (pa.ArrowInvalid, Exit.USAGE),  # an input file that does not parse
    (errors.MemWalError, Exit.FAILED),
    (OSError, Exit.STORAGE),
)


def exit_code(exc: BaseException) -> Exit:
    """The exit code for an error a command raised (`Exit.FAILED` for anything unexpected)."""
    for cls, code in _EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return Exit.FAILED


# ---------------------------------------------------------------------------------------------- args


def key_values(pairs: Sequence[str] | None, what: str) -> dict[str, str]:
    """`["k=v", ...]` as a dict; InvalidArgumentError for an item without `=`."""
    out: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise errors.InvalidArgumentError(f"{what} must be KEY=VALUE, got {pair!r}")
        out[key.strip()] = value
    return out


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="a Lance storage option for s3:// URIs (repeat), e.g. aws_endpoint=http://127.0.0.1:9000",
    )


def add_table(parser: argparse.ArgumentParser) -> None:
    """The table URI (positional) and its storage options."""
    parser.add_argument("uri", help="table location: a local directory or s3://bucket/prefix")
    add_storage_options(parser)


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON (for scripts)")


def storage_options(args: argparse.Namespace) -> dict[str, str] | None:
    return key_values(args.storage_option, "--storage-option") or None


def table_of(args: argparse.Namespace) -> Table:
    return open_table(args.uri, storage_options(args))


def existing_file(path: str) -> Path:
    """`path` as a Path; FileNotFoundError (exit code 3) when it is not a file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    return p


# -------------------------------------------------------------------------------------------- output


def plain(value: Any) -> Any:
    """`value` as JSON-able data: UUIDs as strings, dataclasses as dicts, bytes as hex, durations in s."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, datetime.date | datetime.datetime | datetime.time):
        return value.isoformat()
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    """Print `data` as JSON with `--json`, else `text()`."""
    if getattr(args, "json", False):
        print(json.dumps(plain(data), indent=2))
    else:
        print(text())


def count(n: int, word: str, plural: str | None = None) -> str:
    """`n` with the word in the right number: `1 row`, `2 rows`, `1 WAL entry`, `3 WAL entries`."""
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int = 48) -> str:
    """An aligned plain-text table; cells longer than `max_width` are cut with `…`."""

    def cell(v: Any) -> str:
        s = "NULL" if v is None else str(v)
        s = s.replace("\n", " ")
        return s if len(s) <= max_width else s[: max_width - 1] + "…"

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    line = "  ".join
    out = [line(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    out.append(line("-" * w for w in widths))
    out += [line(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(out)
