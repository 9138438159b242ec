"""`LocalStorage`: a `Storage` on the local file system, for plain paths and `file://` URIs.

Implemented directly with `os` calls (durability and latency matter on the WAL path). Publishing is
temp file + fsync + no-clobber hard link (or `os.replace` for overwrites) + fsync of the directory,
the protocol Lance uses for local shard manifests (`{name}.tmp.{uuid}` then rename-if-not-exists). On
Linux a new object is written to an unnamed `O_TMPFILE` instead, then linked into place: no temp name
is created, removed, or left behind by a crash, and the directory fsync has one entry less to journal.
"""

from __future__ import annotations

import builtins
import errno
import os
import re
import stat
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

from memwal_df.errors import NotFoundError, StorageError
from memwal_df.format.storage import Blob, Storage, check_path, check_prefix
from memwal_df.pools import shared_pool

__all__ = ["LocalStorage"]

# In-flight (or abandoned) temp files of LocalStorage: `{name}.tmp.{uuid}`. They are not objects:
# listings never show them, delete_prefix removes them.
_TEMP_RE = re.compile(r"\.tmp\.[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}$")


def _is_temp(name: str) -> bool:
    return ".tmp." in name and _TEMP_RE.search(name) is not None


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


def _unlink_quiet(path: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


_Stamp = tuple[int, int, int]  # (inode, size, modification time in ns)


def _tree(
    top: str, skip: Collection[str], strict: bool
) -> tuple[dict[str, _Stamp], dict[str, frozenset[str]]]:
    """(every file under `top` with its stamp, every directory with its entry names), leaving out
    the top-level entries in `skip`; a missing `top` is an empty tree unless `strict`. Entries
    removed while listing are left out."""
    files: dict[str, _Stamp] = {}
    dirs: dict[str, frozenset[str]] = {}
    pending = [top]
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            if strict and directory == top:
                raise
            continue
        dirs[directory] = frozenset(e.name for e in entries)
        for e in entries:
            if directory == top and e.name in skip:
                continue
            try:
                if e.is_dir(follow_symlinks=False):
                    pending.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    files[e.path] = (st.st_ino, st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                continue
    return files, dirs


class LocalStorage(Storage):
    """Storage on a local file system (plain paths and `file://` URIs)."""

    def __init__(self, uri: str, root: str, storage_options: dict[str, str] | None = None) -> None:
        super().__init__(uri, storage_options)
        self.root = root  # absolute directory path, no trailing slash (except "/")
        self._base = root if root.endswith("/") else root + "/"

    def __reduce__(self) -> tuple[Any, ...]:
        return (LocalStorage, (self.uri, self.root, self.storage_options or None))

    def _full(self, path: str) -> str:
        return self._base + check_path(path)

    def _dir_of(self, prefix: str) -> str:
        prefix = check_prefix(prefix)
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

    def sync_tree(self, prefix: str, skip: Collection[str] = ()) -> None:
        """fsync every file and directory under `prefix` (but the top-level entries named in `skip`),
        and `prefix`'s own entry in its parent: pylance writes local files without fsync, and a
        manifest must never name a generation that a power loss could take back. Returns when all
        are durable.

        The fsyncs run concurrently (no order among them is needed: the caller commits only after
        this returns); the file system then batches them into fewer journal commits (a generation's
        13 fsyncs took 0.35x the time of one after the other on ext4)."""
        top = self._dir_of(prefix)
        try:
            files, dirs = _tree(top, skip, strict=True)
            # a file that vanished meanwhile was a temp file of a write in flight (pylance renames
            # its own): nothing that exists depends on it
            self._fsync_all(list(files), [*dirs, os.path.dirname(top)], missing_ok=True)
        except OSError as e:
            raise self._error("sync", prefix, e) from e

    @contextmanager
    def synced_changes(self, prefix: str = "", skip: Collection[str] = ()) -> Iterator[None]:
        """The tree under `prefix` is listed before and after the block (file identity, size and
        modification time; each directory's entry names); what differs is fsynced, concurrently.
        A directory created by the block is synced with its parent's entry for it."""
        top = self._dir_of(prefix)
        try:
            before = _tree(top, skip, strict=False)
        except OSError as e:
            raise self._error("sync", prefix, e) from e
        try:
            yield
        finally:
            try:
                files, dirs = _tree(top, skip, strict=False)
                changed = [path for path, stamp in files.items() if before[0].get(path) != stamp]
                # a directory gained or lost entries (a removed directory's parent among them)
                moved = [d for d, names in dirs.items() if before[1].get(d) != names]
                new_dirs = [d for d in dirs if d not in before[1]]
                moved += [os.path.dirname(d) for d in new_dirs if os.path.dirname(d) not in dirs]
                self._fsync_all(changed, sorted(set(moved)), missing_ok=True)
            except OSError as e:
                raise self._error("sync", prefix, e) from e

    @staticmethod
    def _fsync_all(files: builtins.list[str], dirs: builtins.list[str], missing_ok: bool = False) -> None:
        """fsync `files` and `dirs` concurrently; with `missing_ok`, what was removed meanwhile (by
        another process's clean-up) is skipped."""
        if not files and not dirs:
            return
        pool = shared_pool("fsync", _SYNC_THREADS)
        jobs = [(path, _O_FILE_FLAGS) for path in files] + [(path, _O_DIR_FLAGS) for path in dirs]
        for done in [pool.submit(_fsync_path, path, flags) for path, flags in jobs]:
            try:
                done.result()
            except FileNotFoundError:
                if not missing_ok:
                    raise

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

    def list(self, prefix: str) -> builtins.list[str]:
        directory = self._dir_of(prefix)
        rel = check_prefix(prefix)
        out: builtins.list[str] = []
        try:
            self._walk(directory, rel + "/" if rel else "", out)
        except OSError as e:
            raise self._error("list", prefix, e) from e
        out.sort()
        return out

    def _walk(self, directory: str, rel: str, out: builtins.list[str]) -> None:
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

    def list_dir(self, prefix: str) -> builtins.list[str]:
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

    def temp_files(self, prefix: str) -> builtins.list[tuple[str, float]]:
        """(path, modification time) of each temp file directly under `prefix`: a write in flight,
        or one a crash interrupted (listings hide them; `delete` removes one by its path)."""
        rel = check_prefix(prefix)
        found = []
        try:
            with os.scandir(self._dir_of(prefix)) as it:
                for entry in it:
                    if _is_temp(entry.name):
                        try:
                            mtime = entry.stat(follow_symlinks=False).st_mtime
                        except FileNotFoundError:
                            continue  # its write finished meanwhile
                        found.append((f"{rel}/{entry.name}" if rel else entry.name, mtime))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise self._error("list_dir", prefix, e) from e
        return sorted(found)

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
        rel = check_prefix(prefix)
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
        path = check_path(path)
        return self.uri + path if self.uri.endswith("/") else f"{self.uri}/{path}"
