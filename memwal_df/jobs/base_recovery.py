"""Recovery of the base table after a power loss: torn newest versions are rolled back.

memwal_df makes every base commit it makes durable before anything depends on it (each Lance call
that commits runs inside `Storage.synced_changes`; GC and version clean-up sync the whole base
first). Lance itself writes a version's files without fsync and then publishes its manifest, so a
power loss during such a call can leave a newest version whose manifest, data, deletion or index
files did not all survive. Nothing acknowledged depends on such a version: the call had not returned,
so no merge was reported done and no generation or WAL entry was removed on its strength.

`recover_base` checks the newest versions, newest first, and sets each one that does not check out
aside until one checks out (its manifest moves to `_mem_wal/_quarantine/base/{version}-{token}.manifest`,
never deleted); the table then opens at that version, and the generations the rolled-back versions
had absorbed are unmerged again (the merge progress is part of the same manifest). A version checks
out when its manifest loads, every data file it names exists with the size the manifest records and ends with
Lance's file magic, every deletion file decodes to as many rows as the manifest records, and every
index segment's directory holds files of the recorded total size.

Guarantees: on object stores nothing is done (a PUT is whole and durable when it returns); a version
that checks out is never touched; the newest version is never set aside when it is the only one.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import lance

from memwal_df.format import deletion_files, layout
from memwal_df.format.local_storage import LocalStorage
from memwal_df.format.memwal_index import MEMWAL_INDEX_NAME
from memwal_df.format.storage import Storage

__all__ = ["BaseRecovery", "QUARANTINE_DIR", "is_lance_panic", "recover_base", "version_problem"]

QUARANTINE_DIR = f"{layout.MEM_WAL_DIR}/_quarantine/base"
_VERSIONS_DIR = "_versions"
_HINT_FILE = "latest_version_hint.json"
_FILE_MAGIC = b"LANC"
_V2_NAMING = 1 << 63  # Lance names version v `{u64::MAX - v}.manifest` in its V2 scheme


@dataclass(frozen=True)
class BaseRecovery:
    """What `recover_base` did: the versions set aside (newest first), why, and the version the
    table opens at now (None: no version checks out; nothing was set aside then)."""

    rolled_back: tuple[int, ...]
    problems: tuple[str, ...]
    latest: int | None


def _manifests(storage: Storage) -> list[tuple[int, str]]:
    """(version, file name) of every manifest under `_versions/`, newest first."""
    found = []
    for name in storage.list_dir(_VERSIONS_DIR):
        stem, dot, ext = name.partition(".")
        if ext != "manifest" or not stem.isdigit():
            continue
        n = int(stem)
        found.append(((1 << 64) - 1 - n if n >= _V2_NAMING else n, name))
    return sorted(found, reverse=True)


def version_problem(storage: Storage, version: int) -> str | None:
    """Why base `version` did not survive whole (its manifest or a file it names), or None."""
    try:
        ds = lance.dataset(storage.uri, version=version, storage_options=storage.storage_options or None)
        fragments = ds.get_fragments()
        indices = ds.describe_indices()
    except BaseException as e:  # Lance panics (pyo3's PanicException) on some torn bytes
        if not (isinstance(e, OSError | ValueError) or is_lance_panic(e)):
            raise
        return f"its manifest cannot be read: {e}"
    for fragment in fragments:
        meta = fragment.metadata
        for data_file in meta.files:
            problem = _data_file_problem(storage, f"data/{data_file.path}", data_file.file_size_bytes)
            if problem:
                return problem
        if meta.deletion_file is not None:
            path = fragment.deletion_file()
            if path is None:
                return f"fragment {fragment.fragment_id} names a deletion file without a path"
            try:
                offsets = deletion_files.decode(storage.get(path), meta.deletion_file.file_type)
            except (OSError, ValueError) as e:
                return f"deletion file {path} cannot be read: {e}"
            expected = meta.deletion_file.num_deleted_rows
            if expected is not None and len(offsets) != expected:
                return f"deletion file {path} holds {len(offsets)} rows, the manifest records {expected}"
    for index in indices:
        if index.name == MEMWAL_INDEX_NAME:
            continue  # its details live in the manifest
        for segment in index.segments:
            problem = _index_problem(storage, f"_indices/{segment.uuid}", segment.size_bytes)
            if problem:
                return f"index {index.name}: {problem}"
    return None


def is_lance_panic(e: BaseException) -> bool:
    """Whether `e` is a Rust panic raised through pylance (pyo3's `PanicException`, a BaseException
    that cannot be imported by name)."""
    return type(e).__name__ == "PanicException"


def _data_file_problem(storage: Storage, path: str, size: int | None) -> str | None:
    found = storage.head(path)
    if found is None:
        return f"data file {path} is missing"
    if size and found != size:
        return f"data file {path} has {found} bytes, the manifest records {size}"
    if found < len(_FILE_MAGIC) or not _ends_with_magic(storage, path, found):
        return f"data file {path} does not end with Lance's file magic"
    return None


def _ends_with_magic(storage: Storage, path: str, size: int) -> bool:
    if isinstance(storage, LocalStorage):
        with open(os.path.join(storage.root, path), "rb") as f:
            f.seek(size - len(_FILE_MAGIC))
            return f.read(len(_FILE_MAGIC)) == _FILE_MAGIC
    return storage.get(path).endswith(_FILE_MAGIC)


def _index_problem(storage: Storage, directory: str, size: int | None) -> str | None:
    files = storage.list(directory)
    if not files:
        return f"segment directory {directory} is missing or empty"
    total = sum(storage.head(f) or 0 for f in files)
    if size and total != size:
        return f"segment directory {directory} holds {total} bytes, the manifest records {size}"
    return None


def recover_base(storage: Storage) -> BaseRecovery:
    """Set torn newest base versions aside (see the module docstring); durable when it returns."""
    if not isinstance(storage, LocalStorage):
        return BaseRecovery((), (), None)
    manifests = _manifests(storage)
    bad: list[tuple[int, str, str]] = []
    latest = None
    for version, name in manifests:
        problem = version_problem(storage, version)
        if problem is None:
            latest = version
            break
        bad.append((version, name, problem))
    if latest is None or not bad:
        return BaseRecovery((), tuple(p for _, _, p in bad) if latest is None else (), latest)
    storage.delete(f"{_VERSIONS_DIR}/{_HINT_FILE}")  # Lance lists `_versions/` without it
    for version, name, _ in bad:
        path = f"{_VERSIONS_DIR}/{name}"
        aside = f"{QUARANTINE_DIR}/{version}-{secrets.token_hex(4)}.manifest"
        storage.put_if_not_exists(aside, storage.get(path))
        storage.delete(path)
    storage.sync_tree(_VERSIONS_DIR)
    return BaseRecovery(tuple(v for v, _, _ in bad), tuple(p for _, _, p in bad), latest)
