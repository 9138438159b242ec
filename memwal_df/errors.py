"""Typed errors of memwal_df. Every error a user can cause or observe derives from `MemWalError`."""

from __future__ import annotations

import uuid


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
    but some regions have a corrupt WAL entry or region manifest.

    `errors` maps each failed region's id to its `CorruptWalEntryError` / `CorruptManifestError`
    (whose `path` names the file); `result` is what the job did on the other regions (the
    recovered region ids for `recover`, a `MergeResult` / `GcResult` for the others).
    """

    def __init__(self, job: str, errors: dict[uuid.UUID, MemWalError], result: object) -> None:
        lines = "".join(f"\n  region {r}: {e}" for r, e in sorted(errors.items()))
        super().__init__(
            f"{job}: {len(errors)} region(s) could not be read and were skipped (the others were "
            f"processed); see 'Corrupt regions' in docs/operations.md:{lines}"
        )
        self.errors = errors
        self.result = result


class RepairRefusedError(MemWalError, ValueError):
    """`repair_region` found damage it will not set aside without a stronger flag (or cannot repair)."""
