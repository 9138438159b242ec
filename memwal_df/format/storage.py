"""The one module through which memwal_df reads and writes its own files.

WAL entries, region manifests, version hints, bloom filters, pk indexes … all go through a `Storage`
rooted at the table URI. Paths are '/'-separated and relative to that root. Lance tables themselves
are read and written by pylance; `Storage.child_uri` gives the URI to hand it, together with the same
`storage_options`.

Two backends:

* `LocalStorage` for plain paths and `file://` URIs, implemented directly with `os` calls (durability
  and latency matter on the WAL path). Publishing is temp file + fsync + no-clobber hard link (or
  `os.replace` for overwrites) + fsync of the directory, the protocol Lance uses for local shard
  manifests (`{name}.tmp.{uuid}` then rename-if-not-exists). On Linux a new object is written to an
  unnamed `O_TMPFILE` instead, then linked into place: no temp name is created, removed, or left
  behind by a crash, and the directory fsync has one entry less to journal.
* `ObjectStorage` for S3 and anything else obstore supports (`gs://`, `az://`, `memory://` …).
  `put_if_not_exists` is a conditional PUT (`If-None-Match: *`, obstore `mode="create"`).

`storage_options` are Lance's (the dict given to `lance.dataset` / `lance.write_dataset`); see
`obstore_options` for how they map onto obstore's configuration.

Every failure of the underlying store surfaces as `memwal_df.errors.StorageError` (a missing object
as its subclass `NotFoundError`), with the path in the message. Malformed paths (absolute, empty
segments, `.`/`..`) are programming errors and raise `ValueError`.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import stat
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any

import obstore as obs
from obstore.exceptions import AlreadyExistsError, PreconditionError, UnknownConfigurationKeyError
from obstore.store import MemoryStore, from_url

from memwal_df.errors import NotFoundError, StorageError
from memwal_df.pools import shared_pool

# What a write takes: bytes, or a zero-copy view (an encoded WAL entry is a view of an Arrow buffer).
Blob = bytes | memoryview

__all__ = ["Storage", "LocalStorage", "ObjectStorage", "open_storage", "obstore_options"]

_log = logging.getLogger(__name__)

# Outcomes of `Storage.create`.
CREATED, EXISTED, LANDED = "created", "existed", "landed"

# In-flight (or abandoned) temp files of LocalStorage: `{name}.tmp.{uuid}`. They are not objects:
# listings never show them, delete_prefix removes them.
_TEMP_RE = re.compile(r"\.tmp\.[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}$")


def _is_temp(name: str) -> bool:
    return ".tmp." in name and _TEMP_RE.search(name) is not None


def _check_path(path: str) -> str:
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


def _check_prefix(prefix: str) -> str:
    """A prefix is a path or "" (the root); one trailing '/' is tolerated."""
    if not isinstance(prefix, str):
        raise TypeError(f"storage prefix must be a str, got {type(prefix).__name__}")
    prefix = prefix.rstrip("/") if prefix.endswith("/") and prefix != "/" else prefix
    return _check_path(prefix) if prefix else ""


def _first_line(exc: BaseException) -> str:
    """obstore messages carry a multi-line debug dump; the first line says what happened."""
    text = str(exc).strip()
    return text.split("\n", 1)[0] if text else type(exc).__name__


class Storage(ABC):
    """Object-style storage rooted at a table URI. Thread-safe; picklable (re-opened from uri+options)."""

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
    def list(self, prefix: str) -> list[str]:
        """Every object under `prefix` (recursive; "" = whole root), as paths relative to the root, sorted.

        Prefixes match whole path segments: "a/b" lists "a/b/c", never "a/bc" nor "a/b" itself."""

    @abstractmethod
    def list_dir(self, prefix: str) -> list[str]:
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
    def sync_tree(self, prefix: str) -> None:
        """Make everything under `prefix` durable, files written by others (pylance) included."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (open_storage, (self.uri, self.storage_options or None))


# ------------------------------------------------------------------------------------------------
# Local file system
# ------------------------------------------------------------------------------------------------

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
_O_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC
_O_FILE_FLAGS = os.O_RDONLY | _O_CLOEXEC
_O_TMPFILE = getattr(os, "O_TMPFILE", 0)
_O_UNNAMED_FLAGS = os.O_WRONLY | _O_TMPFILE | _O_CLOEXEC
# O_TMPFILE needs Linux, a file system that has it, and /proc to link the file by its descriptor.
_unnamed_files = bool(_O_TMPFILE) and os.path.isdir("/proc/self/fd")
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOSYS)
# fdatasync makes the data and the size durable (all a new file needs); fsync where it is missing.
_datasync = getattr(os, "fdatasync", os.fsync)


def _fsync_path(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    _fsync_path(path, _O_DIR_FLAGS)


_SYNC_THREADS = 8  # concurrent fsyncs of one `LocalStorage.sync_tree`


def _write_all(fd: int, data: Blob) -> None:
    n = os.write(fd, data)
    if n != len(data):  # short write: only for huge buffers or odd file systems
        view = memoryview(data)
        while n < len(view):
            n += os.write(fd, view[n:])


def _as_bytes(data: Blob) -> bytes:
    """obstore takes bytes only."""
    return data if isinstance(data, bytes) else bytes(data)


def _unlink_quiet(path: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


class LocalStorage(Storage):
    """Storage on a local file system (plain paths and `file://` URIs)."""

    def __init__(self, uri: str, root: str, storage_options: dict[str, str] | None = None) -> None:
        super().__init__(uri, storage_options)
        self.root = root  # absolute directory path, no trailing slash (except "/")
        self._base = root if root.endswith("/") else root + "/"

    def _full(self, path: str) -> str:
        return self._base + _check_path(path)

    def _dir_of(self, prefix: str) -> str:
        prefix = _check_prefix(prefix)
        return self._base + prefix if prefix else self.root

    def _error(self, op: str, path: str, exc: OSError) -> StorageError:
        # NotFoundError means "the object does not exist": only a read can say that.
        cls = NotFoundError if op == "get" and isinstance(exc, FileNotFoundError) else StorageError
        err = cls(f"{op} {path!r} in {self.uri}: {exc.strerror or exc}")
        err.errno = exc.errno
        return err

    # -- directories ---------------------------------------------------------------------------

    def _makedirs(self, directory: str) -> None:
        """Create `directory` and missing ancestors, making each new entry durable (fsync parent)."""
        missing = []
        d = directory
        while not os.path.isdir(d):
            missing.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise
                continue
            _fsync_dir(os.path.dirname(d))

    def _open_dir(self, directory: str) -> int:
        try:
            return os.open(directory, _O_DIR_FLAGS)
        except FileNotFoundError:  # first object in this directory
            self._makedirs(directory)
            return os.open(directory, _O_DIR_FLAGS)

    @staticmethod
    def _write_temp(dfd: int, name: str, data: Blob) -> str:
        """Write `data` to a new durable temp file next to `name` (in directory `dfd`); its name."""
        tmp = f"{name}.tmp.{uuid.uuid4()}"
        fd = os.open(tmp, _O_TMP_FLAGS, 0o644, dir_fd=dfd)
        try:
            try:
                _write_all(fd, data)
                _datasync(fd)
            finally:
                os.close(fd)
        except BaseException:
            _unlink_quiet(tmp, dfd)
            raise
        return tmp

    @classmethod
    def _link_new(cls, dfd: int, name: str, data: Blob) -> bool:
        """Publish `data` as `name` unless it exists (atomic, durable content, name not yet synced)."""
        global _unnamed_files
        if _unnamed_files:
            try:
                fd = os.open(".", _O_UNNAMED_FLAGS, 0o644, dir_fd=dfd)
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    raise
                _unnamed_files = False  # this file system has no O_TMPFILE: named temp files
            else:
                try:
                    _write_all(fd, data)
                    _datasync(fd)
                    os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dfd)  # linkat(AT_SYMLINK_FOLLOW)
                    return True
                except FileExistsError:
                    return False
                finally:
                    os.close(fd)
        tmp = cls._write_temp(dfd, name, data)
        try:
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # never replaces an existing entry
            return True
        except FileExistsError:
            return False
        finally:
            _unlink_quiet(tmp, dfd)

    # -- writes --------------------------------------------------------------------------------

    def put_if_not_exists(self, path: str, data: Blob) -> bool:
        full = self._full(path)
        directory, name = os.path.split(full)
        try:
            dfd = self._open_dir(directory)
            try:
                created = self._link_new(dfd, name, data)
                if not created and os.path.isdir(full):
                    raise StorageError(f"put_if_not_exists {path!r} in {self.uri}: a directory exists there")
                # Make the new name durable (and, on a lost race, the winner's name before we act on it).
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            if isinstance(e, StorageError):
                raise
            raise self._error("put_if_not_exists", path, e) from e
        return created

    def put(self, path: str, data: Blob) -> None:
        full = self._full(path)
        directory, name = os.path.split(full)
        try:
            dfd = self._open_dir(directory)
            try:
                tmp = self._write_temp(dfd, name, data)
                try:
                    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException:
                    _unlink_quiet(tmp, dfd)
                    raise
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise self._error("put", path, e) from e

    def sync_tree(self, prefix: str) -> None:
        """fsync every file and directory under `prefix`, and `prefix`'s own entry in its parent:
        pylance writes local files without fsync, and a manifest must never name a generation that
        a power loss could take back. Returns when all are durable.

        The fsyncs run concurrently (no order among them is needed: the caller commits only after
        this returns); the file system then batches them into fewer journal commits (a generation's
        13 fsyncs took 0.35x the time of one after the other on ext4)."""
        top = self._dir_of(prefix)
        try:
            paths = []
            for directory, _, files in os.walk(top):
                paths += [(os.path.join(directory, name), _O_FILE_FLAGS) for name in files]
                paths.append((directory, _O_DIR_FLAGS))
            paths.append((os.path.dirname(top), _O_DIR_FLAGS))
            pool = shared_pool("fsync", _SYNC_THREADS)
            for done in [pool.submit(_fsync_path, path, flags) for path, flags in paths]:
                done.result()
        except OSError as e:
            raise self._error("sync", prefix, e) from e

    # -- reads ---------------------------------------------------------------------------------

    def get(self, path: str) -> bytes:
        full = self._full(path)
        try:
            with open(full, "rb", buffering=0) as f:
                return f.readall()
        except (IsADirectoryError, NotADirectoryError) as e:  # a "directory" is not an object
            raise NotFoundError(f"get {path!r} in {self.uri}: no such object ({e.strerror})") from e
        except OSError as e:
            raise self._error("get", path, e) from e

    def head(self, path: str) -> int | None:
        full = self._full(path)
        try:
            st = os.stat(full)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise self._error("head", path, e) from e
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str) -> list[str]:
        directory = self._dir_of(prefix)
        rel = _check_prefix(prefix)
        out: list[str] = []
        try:
            self._walk(directory, rel + "/" if rel else "", out)
        except OSError as e:
            raise self._error("list", prefix, e) from e
        out.sort()
        return out

    def _walk(self, directory: str, rel: str, out: list[str]) -> None:
        try:
            it = os.scandir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return
        with it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    self._walk(entry.path, rel + entry.name + "/", out)
                elif not _is_temp(entry.name) and entry.is_file():
                    out.append(rel + entry.name)

    def list_dir(self, prefix: str) -> list[str]:
        directory = self._dir_of(prefix)
        try:
            with os.scandir(directory) as it:
                names = [e.name for e in it if not _is_temp(e.name)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise self._error("list_dir", prefix, e) from e
        names.sort()
        return names

    # -- deletes -------------------------------------------------------------------------------

    def delete(self, path: str) -> None:
        full = self._full(path)
        try:
            os.unlink(full)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            pass  # absent (a directory is not an object)
        except PermissionError as e:
            if e.errno == errno.EPERM and os.path.isdir(full):  # unlink(dir) is EPERM on some systems
                return
            raise self._error("delete", path, e) from e
        except OSError as e:
            raise self._error("delete", path, e) from e

    def delete_prefix(self, prefix: str) -> int:
        rel = _check_prefix(prefix)
        directory = self._dir_of(prefix)
        try:
            n = self._remove_tree(directory)
            if rel:
                try:
                    os.rmdir(directory)
                except (FileNotFoundError, NotADirectoryError):
                    pass
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):  # a concurrent writer
                        raise
        except OSError as e:
            raise self._error("delete_prefix", prefix, e) from e
        return n

    def _remove_tree(self, directory: str) -> int:
        """Remove everything inside `directory` (not the directory itself); count removed objects."""
        try:
            it = os.scandir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        n = 0
        with it:
            entries = list(it)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                n += self._remove_tree(entry.path)
                try:
                    os.rmdir(entry.path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
            else:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
                if not _is_temp(entry.name):
                    n += 1
        return n

    def child_uri(self, path: str) -> str:
        path = _check_path(path)
        return self.uri + path if self.uri.endswith("/") else f"{self.uri}/{path}"


# ------------------------------------------------------------------------------------------------
# Object stores (obstore)
# ------------------------------------------------------------------------------------------------

# obstore `ClientConfig` keys (HTTP client); object_store also accepts them with a provider prefix.
_CLIENT_KEYS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "http1_only",
        "http2_keep_alive_interval",
        "http2_keep_alive_timeout",
        "http2_keep_alive_while_idle",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_ca_certificate",
        "proxy_excludes",
        "proxy_url",
        "randomize_addresses",
        "read_timeout",
        "timeout",
        "user_agent",
    }
)
_CLIENT_PREFIXES = ("aws_", "google_", "azure_")
_S3_SCHEMES = frozenset({"s3", "s3a"})
_S3_REGION_KEYS = ("aws_region", "region", "aws_default_region", "default_region")
_S3_ENDPOINT_KEYS = ("aws_endpoint", "aws_endpoint_url", "endpoint", "endpoint_url", "aws_endpoint_url_s3")
_LANCE_DEFAULT_REGION = "us-west-2"  # Lance's fallback when an endpoint is set and no region is known


@functools.cache
def _config_key_known(scheme: str, key: str) -> bool:
    """Whether obstore's store for `scheme` accepts config key `key` (object_store's own key parser,
    the one Lance uses). Lance silently ignores keys its store does not know; so do we."""
    try:
        from_url(f"{scheme}://memwal-probe", config={key: "x"})
    except UnknownConfigurationKeyError:
        return False
    except Exception:  # known key, probe value or missing settings rejected: fine
        return True
    return True


def _resolve_bucket_region(bucket: str) -> str | None:
    """The region of an AWS bucket, from the `x-amz-bucket-region` header (what Lance does when no
    region and no endpoint is configured). None if it cannot be found."""
    req = urllib.request.Request(f"https://{bucket}.s3.amazonaws.com", method="HEAD")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.headers.get("x-amz-bucket-region")
    except urllib.error.HTTPError as e:  # 301/403 still carry the header
        return e.headers.get("x-amz-bucket-region")
    except OSError as e:
        _log.debug("could not resolve the region of bucket %s: %s", bucket, e)
        return None


def obstore_options(
    scheme: str, storage_options: dict[str, str] | None
) -> tuple[dict[str, str], dict[str, str], dict[str, Any]]:
    """Map Lance `storage_options` to obstore's (config, client_options, retry_config).

    * keys are case-insensitive (lower-cased, as Lance does); empty values are dropped;
    * HTTP client keys (`allow_http`, `timeout`, `connect_timeout`, `proxy_url`, … also with an
      `aws_`/`google_`/`azure_` prefix, e.g. `aws_allow_http`) → client_options;
    * Lance's `client_max_retries` / `client_retry_timeout` (seconds) → retry_config;
    * every other key that object_store knows for the scheme (`aws_endpoint`, `aws_access_key_id`,
      `aws_secret_access_key`, `aws_session_token`, `aws_region`, `aws_virtual_hosted_style_request`,
      and their aliases `endpoint`, `access_key_id`, `token`, `region` …) → config unchanged;
    * anything else (Lance-only keys such as `download_retry_count`, `use_opendal`,
      `expires_at_millis`, `lance_*`) is ignored, as Lance's object store ignores it.
    """
    config: dict[str, str] = {}
    client: dict[str, str] = {}
    retry: dict[str, Any] = {}
    for raw_key, raw_value in (storage_options or {}).items():
        key = str(raw_key).lower()
        value = _option_str(raw_value)
        if value == "":
            continue
        stripped = key
        for p in _CLIENT_PREFIXES:
            if key.startswith(p) and key[len(p) :] in _CLIENT_KEYS:
                stripped = key[len(p) :]
                break
        if stripped in _CLIENT_KEYS:
            client[stripped] = value
        elif key == "client_max_retries":
            retry["max_retries"] = int(value)
        elif key == "client_retry_timeout":
            retry["retry_timeout"] = timedelta(seconds=float(value))
        elif scheme != "memory" and _config_key_known(scheme, key):
            config[key] = value
        else:
            _log.debug("storage option %r is not used by memwal_df's %s store", raw_key, scheme)
    return config, client, retry


def _option_str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_MEMORY_STORES: dict[str, Any] = {}
_MEMORY_LOCK = threading.Lock()


def _memory_store(name: str) -> Any:
    """memory:// stores are process-wide, one per authority, so that two opens see the same objects."""
    with _MEMORY_LOCK:
        store = _MEMORY_STORES.get(name)
        if store is None:
            store = _MEMORY_STORES[name] = MemoryStore()
        return store


_RETRIED_RE = re.compile(r"(?<![a-z_])retries: ([1-9]\d*)")  # not "max_retries: 10"


class ObjectStorage(Storage):
    """Storage on an object store through obstore. `prefix` is the root's key prefix inside `store`."""

    def __init__(self, uri: str, store: Any, prefix: str, storage_options: dict[str, str] | None) -> None:
        super().__init__(uri, storage_options)
        self.store = store
        self.prefix = prefix
        self._base = prefix + "/" if prefix else ""

    def _key(self, path: str) -> str:
        return self._base + _check_path(path)

    def _prefix_key(self, prefix: str) -> str | None:
        prefix = _check_prefix(prefix)
        key = self._base + prefix if prefix else self.prefix
        return key or None

    def _rel(self, key: str) -> str:
        return key[len(self._base) :]

    def _error(self, op: str, path: str, exc: Exception) -> StorageError:
        # NotFoundError means "the object does not exist": only a read can say that (a PUT into a
        # missing bucket is a 404 too, but it is a StorageError).
        cls = NotFoundError if op == "get" and isinstance(exc, FileNotFoundError) else StorageError
        return cls(f"{op} {path!r} in {self.uri}: {_first_line(exc)}")

    def put_if_not_exists(self, path: str, data: Blob) -> bool:
        return self.create(path, data) != EXISTED

    def create(self, path: str, data: Blob) -> str:
        key = self._key(path)
        data = _as_bytes(data)
        for attempt in range(4):
            try:
                obs.put(self.store, key, data, mode="create", use_multipart=False)
                return CREATED
            except (AlreadyExistsError, PreconditionError) as e:
                # A PUT that object_store retried (e.g. after a timeout) may have been our own write
                # landing the first time: the 412 may then be about ourselves, or about someone who
                # wrote the same bytes meanwhile. Only the caller can tell those apart.
                if _RETRIED_RE.search(str(e)) and self._get_or_none(key) == data:
                    return LANDED
                return EXISTED
            except Exception as e:
                # S3 answers 409 ConditionalRequestConflict when a conditional write overlaps a
                # concurrent one or a delete; AWS documents it as retryable.
                msg = str(e)
                if attempt < 3 and ("409 Conflict" in msg or "ConditionalRequestConflict" in msg):
                    continue
                # No answer (a timeout, a reset connection) says nothing about whether the PUT
                # landed: what the store holds now does. Nothing readable there: the error stands.
                existing = self._get_or_none(key)
                if existing is None:
                    raise self._error("put_if_not_exists", path, e) from e
                return LANDED if existing == data else EXISTED
        raise AssertionError("unreachable")

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return bytes(obs.get(self.store, key).bytes())
        except Exception:
            return None

    def put(self, path: str, data: Blob) -> None:
        key = self._key(path)
        try:
            obs.put(self.store, key, _as_bytes(data), use_multipart=False)
        except Exception as e:
            raise self._error("put", path, e) from e

    def sync_tree(self, prefix: str) -> None:
        """Nothing to do: a PUT is durable when it returns."""

    def get(self, path: str) -> bytes:
        key = self._key(path)
        try:
            return bytes(obs.get(self.store, key).bytes())
        except Exception as e:
            raise self._error("get", path, e) from e

    def head(self, path: str) -> int | None:
        key = self._key(path)
        try:
            return int(obs.head(self.store, key)["size"])
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._error("head", path, e) from e

    def _list_keys(self, prefix: str) -> list[str]:
        key = self._prefix_key(prefix)
        try:
            return [m["path"] for chunk in obs.list(self.store, key, chunk_size=1000) for m in chunk]
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._error("list", prefix, e) from e

    def list(self, prefix: str) -> list[str]:
        return sorted(self._rel(k) for k in self._list_keys(prefix))

    def list_dir(self, prefix: str) -> list[str]:
        key = self._prefix_key(prefix)
        try:
            res = obs.list_with_delimiter(self.store, key)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._error("list_dir", prefix, e) from e
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]}
        names.update(m["path"].rsplit("/", 1)[-1] for m in res["objects"])
        return sorted(names)

    def delete(self, path: str) -> None:
        key = self._key(path)
        try:
            obs.delete(self.store, key)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._error("delete", path, e) from e

    def delete_prefix(self, prefix: str) -> int:
        keys = self._list_keys(prefix)
        if not keys:
            return 0
        try:
            obs.delete(self.store, keys)  # bulk (DeleteObjects on S3)
        except Exception:
            # Some stores fail a bulk delete when one object is already gone: fall back to one by one.
            for key in keys:
                self.delete(self._rel(key))
        return len(keys)

    def child_uri(self, path: str) -> str:
        return f"{self.uri}/{_check_path(path)}"


# ------------------------------------------------------------------------------------------------


def open_storage(uri: str, storage_options: dict[str, str] | None = None) -> Storage:
    """Open the Storage rooted at `uri` (a local path, `file://`, `s3://`, `memory://`, … URI) with
    Lance-style `storage_options`."""
    uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"invalid storage URI {uri!r}")
    options = {str(k): _option_str(v) for k, v in (storage_options or {}).items()}
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.lower()

    if len(scheme) <= 1 or ("://" not in uri and scheme != "file"):  # a plain path (or a drive letter)
        root = os.path.abspath(uri)
        return LocalStorage(root, root, options)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise StorageError(f"file URI with a remote host is not supported: {uri}")
        root = os.path.abspath(urllib.parse.unquote(parts.path) or "/")
        return LocalStorage(f"file://{root}" if root != "/" else "file:///", root, options)

    path = parts.path.strip("/")
    norm_uri = f"{scheme}://{parts.netloc}" + (f"/{path}" if path else "")
    if scheme == "memory":
        return ObjectStorage(norm_uri, _memory_store(parts.netloc), path, options)

    config, client, retry = obstore_options(scheme, options)
    if scheme in _S3_SCHEMES:
        _default_s3_region(parts.netloc, config)
    try:
        store = from_url(
            f"{scheme}://{parts.netloc}",
            config=config or None,
            client_options=client or None,
            retry_config=retry or None,
        )
    except Exception as e:
        raise StorageError(f"cannot open storage at {norm_uri}: {_first_line(e)}") from e
    return ObjectStorage(norm_uri, store, path, options)


def _default_s3_region(bucket: str, config: dict[str, str]) -> None:
    """Pick the region the way Lance does when none is configured (options or AWS_REGION /
    AWS_DEFAULT_REGION): with a custom endpoint, us-west-2; on AWS, the bucket's own region."""
    if any(k in config for k in _S3_REGION_KEYS):
        return
    if os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
        return
    if any(k in config for k in _S3_ENDPOINT_KEYS) or any(
        os.environ.get(k) for k in ("AWS_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
    ):
        config["region"] = _LANCE_DEFAULT_REGION
        return
    region = _resolve_bucket_region(bucket)
    if region:
        config["region"] = region
