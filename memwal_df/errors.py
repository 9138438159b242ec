"""Typed errors of memwal_df. Every error a user can cause or observe derives from `MemWalError`.

DataFusion turns an exception raised inside SQL (a table function such as `vector_search`, or a
scan) into a plain error carrying the original's class and message as text: `unwrap` rebuilds the
typed error from it, and `memwal_df.query(ctx, sql)` runs a query and raises that typed error.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import re
import sys
import uuid
from collections.abc import Iterator, Mapping


class MemWalError(Exception):
    """Base class of every memwal_df error."""


class SchemaMismatchError(MemWalError, ValueError):
    """Data whose schema does not match the table's (missing, extra or differently typed columns)."""


class MissingColumnsError(SchemaMismatchError):
    """Input that lacks columns the operation needs: a put needs every column of the table (it
    replaces whole rows), a delete or lookup every primary-key column. `columns` names them."""

    def __init__(self, message: str, columns: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.columns = columns


class InvalidArgumentError(MemWalError, ValueError):
    """An argument that cannot be parsed: command-line text (schema, region spec, `key=value`) or an
    API argument of the wrong form (a region id that is not a UUID)."""


class NullPrimaryKeyError(MemWalError, ValueError):
    """A row whose primary key (or a part of a composite key) is NULL."""


class RegionRoutingError(MemWalError, ValueError):
    """A row that belongs to another region than the writer's, or a region spec that cannot route it."""


class UnknownRegionError(RegionRoutingError):
    """A region id that names no existing region of a table with a region spec (a new region is named
    by its region values, so that every key lands in the one region the spec assigns it)."""


class WriterFencedError(MemWalError):
    """A newer writer claimed the region; this writer can make no more changes.

    `not_durable` holds the data (an Arrow table, possibly empty) of writes that this writer accepted
    but never stored in the WAL, so the caller can retry them through the new writer.
    """

    def __init__(self, message: str, not_durable: object | None = None) -> None:
        super().__init__(message)
        self.not_durable = not_durable


class CorruptWalEntryError(MemWalError):
    """A WAL entry that cannot be decoded (truncated, corrupt, or of an unknown shape)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(f"{message}: {path}")
        self.path = path


class CorruptManifestError(MemWalError):
    """A region manifest or base-table manifest that cannot be decoded."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(f"{message}: {path}")
        self.path = path


class CorruptGenerationError(MemWalError):
    """A flushed generation whose files do not match what was written: a file whose size or
    checksum differs from its checksum sidecar, a listed file that is missing, an unlisted file, a
    damaged sidecar; or, for a generation without a sidecar (Lance's own), rows that contradict its
    region manifest entry (row count, a primary key twice). `path` names the file (or directory),
    `region_id` and `generation` the generation."""

    path: str

    def __init__(
        self, message: str, path: str, region_id: uuid.UUID | None = None, generation: int | None = None
    ) -> None:
        super().__init__(f"{message}: {path}")
        self.path = path
        self._named = (region_id, generation)

    @property
    def region_id(self) -> uuid.UUID | None:
        return getattr(self, "_named", (None, None))[0] or _generation_of(self.path)[0]

    @property
    def generation(self) -> int | None:
        found = getattr(self, "_named", (None, None))[1]
        return found if found is not None else _generation_of(self.path)[1]


_GENERATION_PATH = re.compile(r"_mem_wal/([0-9a-f-]{36})/[0-9a-f]{8}_gen_([0-9]+)(?:/|$)")


def _generation_of(path: str) -> tuple[uuid.UUID | None, int | None]:
    """(region, generation) named by a path inside a generation directory (an error `unwrap` rebuilt
    from text carries only its path)."""
    m = _GENERATION_PATH.match(path or "")
    return (uuid.UUID(m.group(1)), int(m.group(2))) if m else (None, None)


class CommitConflictError(MemWalError):
    """A commit lost a race (put-if-not-exists found the version taken) and could not be retried."""


class BackpressureTimeoutError(MemWalError, TimeoutError):
    """A write waited longer than its timeout for unflushed MemTable bytes to drop below the limit."""


class TableNotFoundError(MemWalError, FileNotFoundError):
    """No Lance table at the URI, or the table has no MemWAL index."""


class TableExistsError(MemWalError, FileExistsError):
    """`create_table` was asked to create a table where one already exists."""


class InvalidRegionSpecError(MemWalError, ValueError):
    """A region spec that is malformed (unknown transform, bad parameter, unknown source column)."""


class NonKeyRegionColumnError(InvalidRegionSpecError):
    """A region spec that reads columns outside the primary key: an upsert that changes such a column
    would put its key into a second region. Refused when a spec is created or bound, and by writers
    of a table whose spec was made elsewhere unless they opt in (`allow_non_key_region_columns`)."""


class MissingGenerationError(MemWalError, FileNotFoundError):
    """A flushed generation listed in a region manifest whose directory does not exist."""


class StorageError(MemWalError, OSError):
    """An object store or file system operation failed."""


class NotFoundError(StorageError, FileNotFoundError):
    """The object does not exist."""


class WriterClosedError(MemWalError):
    """An operation on a writer that was closed (or failed and was closed)."""


class InvalidConfigError(MemWalError, ValueError):
    """A MemWAL configuration Lance or the spec refuses (unknown maintained index, bad writer setting)."""


class CorruptRegionsError(MemWalError):
    """A job that covers many regions (`recover`, `merge`, `gc`) did its work on every healthy region,
    but some regions have a corrupt WAL entry or region manifest (or, for `merge`, a corrupt
    flushed generation).

    `errors` maps each failed region's id to its `CorruptWalEntryError` / `CorruptManifestError` /
    `CorruptGenerationError` (whose `path` names the file); `result` is what the job did on the
    other regions (the recovered region ids for `recover`, a `MergeResult` / `GcResult` for the
    others).
    """

    def __init__(self, job: str, errors: Mapping[uuid.UUID, MemWalError], result: object) -> None:
        lines = "".join(f"\n  region {r}: {e}" for r, e in sorted(errors.items()))
        super().__init__(
            f"{job}: {len(errors)} region(s) could not be read and were skipped (the others were "
            f"processed); see 'Corrupt regions' in docs/operations.md:{lines}"
        )
        self.errors = errors
        self.result = result


class RepairRefusedError(MemWalError, ValueError):
    """`repair_region` found damage it will not set aside without a stronger flag (or cannot repair)."""


class InvalidFilterError(InvalidConfigError):
    """A filter given as SQL text that does not parse, names a column the table lacks, or compares
    a column with a value of another type."""


class TableNotRegisteredError(MemWalError, KeyError):
    """A SQL function named a table that is not registered as a MemWAL table in the context."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# an error raised where DataFusion plans the query (a table function): the PyErr's Debug text
_PY_ERR = re.compile(
    r"PyErr \{ type: <class 'memwal_df\.errors\.(?P<cls>\w+)'>, "
    r"value: (?P=cls)\((?P<args>.*?)\), traceback: ",
    re.DOTALL,
)
# an error raised while a scan runs: Arrow's external error, `Class: message`
_EXTERNAL = re.compile(r"External error: (?P<cls>\w+): (?P<message>.*)\Z", re.DOTALL)


# the longest first line `headline` gives a message: with the prefixes DataFusion adds to an error
# raised in a scan ("DataFusion error: Arrow error: External error: SomeError: ") under 200 characters
HEADLINE_CHARS = 100
_CUT = " …"


def headline(message: str) -> str:
    """The first line of `message`, cut to at most `HEADLINE_CHARS` characters (at the last ": " or
    space before the limit, marked with " …"): what a one-line report of the error shows."""
    first = message.split("\n", 1)[0]
    if len(first) <= HEADLINE_CHARS:
        return first
    room = first[:HEADLINE_CHARS]
    cut = room.rfind(": ")
    if cut < HEADLINE_CHARS // 3:
        cut = room.rfind(" ")
    return (room[:cut] if cut > 0 else room) + _CUT


def for_sql(exc: MemWalError) -> MemWalError:
    """`exc` as memwal_df raises it into a DataFusion scan: DataFusion shows an error raised there as
    `Type: message` after its own prefixes, so a message whose first line is longer than
    `HEADLINE_CHARS` gets its `headline` as a first line of its own (the whole message follows;
    `unwrap` drops the added line). The same class and attributes."""
    text = str(exc)
    head = headline(text)
    if not head.endswith(_CUT) or head == text.split("\n", 1)[0]:
        return exc
    out = type(exc).__new__(type(exc))
    Exception.__init__(out, f"{head}\n{text}")
    out.__dict__.update(exc.__dict__)
    return out


@contextlib.contextmanager
def raised_into_sql() -> Iterator[None]:
    """Around code DataFusion calls to scan a table: a memwal_df error leaves as `for_sql` gives it."""
    try:
        yield
    except MemWalError as e:
        out = for_sql(e)
        if out is e:
            raise
        raise out from e


def _without_headline(message: str) -> str:
    """`message` without the first line `for_sql` added to it."""
    head, sep, rest = message.partition("\n")
    if sep and head.endswith(_CUT) and rest.startswith(head[: -len(_CUT)]):
        return rest
    return message


def sql_error(exc: Exception) -> Exception:
    """The error DataFusion raised for a SQL query (`exc`, a plain `ValueError` / `Exception`) with a
    first line naming the memwal_df error it carries: `SomeError: headline of its message`; the rest
    of the text is DataFusion's, without the Python traceback it embeds. `exc` itself when it
    carries no memwal_df error or is already typed."""
    typed = unwrap(exc)
    if typed is exc or not isinstance(typed, MemWalError):
        return exc
    text = _PY_TRACEBACK.sub("traceback: None", str(exc))
    out = type(exc)(f"{type(typed).__name__}: {headline(str(typed))}\n{text}")
    out.__cause__ = exc
    return out


# pyo3 formats the PyErr of a table function with `{:?}`: the traceback as a quoted Rust string
_PY_TRACEBACK = re.compile(r'traceback: Some\("(?:[^"\\]|\\.)*"\)', re.DOTALL)


def unwrap(exc: BaseException) -> BaseException:
    """The memwal_df error that `exc` (an error DataFusion raised for a SQL query) carries as text,
    rebuilt with its type and message, its `__cause__` set to `exc`; `exc` itself when it is
    already typed or carries no memwal_df error."""
    if isinstance(exc, MemWalError):
        return exc
    found = _carried(str(exc))
    if found is None:
        return exc
    typed = _rebuild(*found)
    typed.__cause__ = exc
    return typed


def _carried(text: str) -> tuple[type[MemWalError], tuple[object, ...]] | None:
    """The memwal_df error class named in `text` and its arguments."""
    if m := _PY_ERR.search(text):
        try:
            args = ast.literal_eval(f"({m.group('args')},)") if m.group("args") else ()
        except (ValueError, SyntaxError):
            args = (m.group("args"),)
    elif m := _EXTERNAL.search(text):
        args = (_without_headline(m.group("message").strip()),)
    else:
        return None
    cls = getattr(sys.modules[__name__], m.group("cls"), None)
    if not (isinstance(cls, type) and issubclass(cls, MemWalError)):
        return None
    return cls, tuple(args)


def _rebuild(cls: type[MemWalError], args: tuple[object, ...]) -> MemWalError:
    """`cls` with `args` as its exception arguments (its constructor may take other parameters)."""
    try:
        return cls(*args)
    except TypeError:
        err = cls.__new__(cls)
        Exception.__init__(err, *args)
        if "path" in inspect.signature(cls.__init__).parameters and args:
            err.path = str(args[0]).rsplit(": ", 1)[-1]  # type: ignore[attr-defined]
        return err


class NullDeleteFlagError(MemWalError, ValueError):
    """A row of a stream written with a `delete_column` has NULL there: it is neither an upsert nor
    a delete."""


class ChangesExpiredError(MemWalError):
    """A change-feed read whose start offset needs changes that garbage collection removed: the
    generations holding them are gone (`region`: the region, `offset`: the (generation, position)
    asked for, `first_retained`: its oldest generation still held). Register the consumer
    (`Table.register_consumer`) so that GC keeps what it has not read."""

    def __init__(
        self,
        message: str,
        region: uuid.UUID | None = None,
        offset: tuple[int, int] | None = None,
        first_retained: int | None = None,
    ) -> None:
        super().__init__(message)
        self.region = region
        self.offset = offset
        self.first_retained = first_retained


class InvalidConditionError(InvalidArgumentError):
    """A conditional write's condition that cannot be evaluated: `if_match` on an unknown or key
    column, or with expected values of another type or count than the rows."""


class MissingValueError(SchemaMismatchError):
    """A partial write that would create a row (its key has no live row) without a value for a
    non-nullable column it does not carry. `columns` names them; nothing of the write is applied."""

    def __init__(self, message: str, columns: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.columns = columns
