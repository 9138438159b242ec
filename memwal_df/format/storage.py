"""The `Storage` interface: the one way memwal_df reads and writes its own files.

WAL entries, region manifests, version hints, bloom filters, pk indexes … all go through a `Storage`
rooted at the table URI. Paths are '/'-separated and relative to that root. Lance tables themselves
are read and written by pylance; `Storage.child_uri` gives the URI to hand it, together with the same
`storage_options`.

Two backends, each in its own module: `local_storage.LocalStorage` (plain paths and `file://` URIs)
and `object_storage.ObjectStorage` (S3 and anything else obstore supports). `open_storage.open_storage`
picks one for a URI. This module holds what both share: the interface, the outcomes of `create`,
path and prefix validation and the text form of option values.

Every failure of the underlying store surfaces as `memwal_df.errors.StorageError` (a missing object
as its subclass `NotFoundError`), with the path in the message. Malformed paths (absolute, empty
segments, `.`/`..`) are programming errors and raise `ValueError`.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

# What a write takes: bytes, or a zero-copy view (an encoded WAL entry is a view of an Arrow buffer).
Blob = bytes | memoryview

__all__ = ["Blob", "Storage", "CREATED", "EXISTED", "LANDED", "check_path", "check_prefix", "option_str"]

# Outcomes of `Storage.create`.
CREATED, EXISTED, LANDED = "created", "existed", "landed"


def check_path(path: str) -> str:
    """Validate an object path: relative, '/'-separated, no empty, '.' or '..' segments."""
    if not isinstance(path, str):
        raise TypeError(f"storage path must be a str, got {type(path).__name__}")
    if (
        not path
        or path[0] == "/"
        or path[-1] == "/"
        or "//" in path
        or "\x00" in path
        or ("." in path and any(seg in (".", "..") for seg in path.split("/")))
    ):
        raise ValueError(f"invalid storage path {path!r}: expected a relative '/'-separated path")
    return path


def check_prefix(prefix: str) -> str:
    """A prefix is a path or "" (the root); one trailing '/' is tolerated."""
    if not isinstance(prefix, str):
        raise TypeError(f"storage prefix must be a str, got {type(prefix).__name__}")
    prefix = prefix.rstrip("/") if prefix.endswith("/") and prefix != "/" else prefix
    return check_path(prefix) if prefix else ""


def option_str(value: Any) -> str:
    """A Lance storage option value as text (booleans as `true` / `false`, as Lance writes them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class Storage(ABC):
    """Object-style storage rooted at a table URI. Thread-safe. Each backend pickles as its uri and
    options, and is re-opened from them when unpickled."""

    uri: str
    storage_options: dict[str, str]

    def __init__(self, uri: str, storage_options: dict[str, str] | None) -> None:
        self.uri = uri
        self.storage_options = dict(storage_options or {})

    @abstractmethod
    def put_if_not_exists(self, path: str, data: Blob) -> bool:
        """Write `path` only if no object exists there. True if written; False if one already existed.

        Atomic: a reader sees either no object or the whole of `data`. Durable when it returns."""

    def create(self, path: str, data: Blob) -> str:
        """`put_if_not_exists` with how it went: `CREATED` (this call wrote `data`), `EXISTED` (another
        object was there), or `LANDED`: the store gave no clear answer (a retried or timed-out request)
        but `path` now holds exactly `data`, written by this call *or by someone who wrote the same
        bytes*. Callers whose bytes do not identify the writer must not take `LANDED` as their own."""
        return CREATED if self.put_if_not_exists(path, data) else EXISTED

    @abstractmethod
    def put(self, path: str, data: Blob) -> None:
        """Create or overwrite `path` atomically (readers see the old or the new object, whole)."""

    @abstractmethod
    def get(self, path: str) -> bytes:
        """The object's bytes; `NotFoundError` if absent."""

    @abstractmethod
    def head(self, path: str) -> int | None:
        """The object's size in bytes, or None if absent."""

    def exists(self, path: str) -> bool:
        return self.head(path) is not None

    @abstractmethod
    def list(self, prefix: str) -> builtins.list[str]:
        """Every object under `prefix` (recursive; "" = whole root), as paths relative to the root, sorted.

        Prefixes match whole path segments: "a/b" lists "a/b/c", never "a/bc" nor "a/b" itself."""

    @abstractmethod
    def list_dir(self, prefix: str) -> builtins.list[str]:
        """Names (not paths) of the immediate children of `prefix` — objects and "directories" — sorted."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove the object at `path`; no error if it does not exist."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under `prefix` (same matching as `list`); returns how many were removed."""

    @abstractmethod
    def child_uri(self, path: str) -> str:
        """URI of `path` under the root, for pylance (use it with `self.storage_options`)."""

    @abstractmethod
    def sync_tree(self, prefix: str, skip: Collection[str] = ()) -> None:
        """Make everything under `prefix` durable, files written by others (pylance) included;
        `skip` names top-level entries under `prefix` to leave out."""

    @contextmanager
    def synced_changes(self, prefix: str = "", skip: Collection[str] = ()) -> Iterator[None]:
        """Make what the block writes, renames or removes under `prefix` durable before it exits
        (also when it raises): the files it created or changed and the directories whose entries it
        changed. `skip` as in `sync_tree`. On object stores there is nothing to do: a completed PUT
        or DELETE is durable."""
        yield

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
