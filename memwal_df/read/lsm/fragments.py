"""Row takes from a Lance dataset's fragments: by visible offset within one fragment, or by row address.

Guarantees: `fragment_take` and `take_addresses` return exactly the rows asked for, in the order
asked; a `FragmentSession` (open file readers, about half the cost of a `_take_rows`) is kept per
dataset object, fragment and column list, and goes with the dataset object.

A take reads one small range per row and column. Lance's default local reader hands each range to a
thread of its own (a context switch per range); on Linux, a local dataset's sessions are opened
through Lance's io_uring reader instead (the same files at the same version, opened as
`file+uring://`, for reads only), which submits them together. If that reader fails where the
default one succeeds (io_uring not permitted in the process, as under Docker's default seccomp
profile), the process uses the default reader from then on. `MEMWAL_DF_URING=0` turns it off.
"""

from __future__ import annotations

import os
import sys
import urllib.parse
from collections.abc import Sequence
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from memwal_df.errors import NotFoundError
from memwal_df.read.exec.batches import projected_schema
from memwal_df.read.lsm.cache import PerObjectCache

__all__ = ["fragment_take", "take_addresses"]

_MAX_SESSIONS = 64  # per dataset object: one per fragment and column list in use
_sessions: PerObjectCache[lance.LanceDataset, dict[tuple[int, tuple[str, ...]], _Session]] = PerObjectCache()
_whole: PerObjectCache[lance.LanceDataset, dict[int, bool]] = PerObjectCache()


def fragment_take(
    ds: lance.LanceDataset, fragment_id: int, offsets: np.ndarray, columns: Sequence[str]
) -> pa.Table:
    """The rows at `offsets` (strictly increasing) among the visible rows of fragment `fragment_id`
    (one of `ds`'s fragments: every caller takes the id from `ds`), read through a `FragmentSession`
    kept per dataset object, fragment and column list (it keeps the file readers open: a take costs
    about half of `_take_rows`), opened through the io_uring reader when it serves."""
    sessions = _sessions.get(ds, dict)
    key = (fragment_id, tuple(columns))
    indices = pa.array(offsets, pa.uint64())
    session = sessions.get(key)
    if session is not None and session.uring and not _uring.enabled:  # a forked child: see `_Uring`
        session = None
    if session is None:
        if len(sessions) >= _MAX_SESSIONS:
            sessions.clear()
        twin = _uring_twin(ds)
        session = sessions[key] = _Session(twin or ds, fragment_id, columns, uring=twin is not None)
    try:
        return session.take(indices)
    except (OSError, ValueError):
        if not session.uring:
            raise
        plain = _Session(ds, fragment_id, columns, uring=False)
        taken = plain.take(indices)  # (raises if the default reader cannot read it either)
        _uring.disable()  # the io_uring reader failed where the default one reads
        sessions[key] = plain
        return taken


class _Session:
    """The `FragmentSession` of one fragment and column list, opened by its first take."""

    def __init__(self, ds: lance.LanceDataset, fragment_id: int, columns: Sequence[str], uring: bool) -> None:
        self.uring = uring
        self._open = (ds, fragment_id, list(columns))
        self._session: Any = None

    def take(self, indices: pa.Array) -> pa.Table:
        if self._session is None:
            ds, fragment_id, columns = self._open
            fragment = ds.get_fragment(fragment_id)
            assert fragment is not None, f"fragment {fragment_id} is not one of the dataset's"
            self._session = fragment.open_session(columns)
        return self._session.take(indices)


class _Uring:
    """Whether this process reads local datasets through Lance's io_uring reader. Not in a child
    forked from this process: Lance's io_uring threads stay behind in the parent (a take through them
    crashes the child), so a forked child reads through the default reader, also from the sessions
    and datasets it inherited."""

    def __init__(self) -> None:
        self.enabled = sys.platform == "linux" and os.environ.get("MEMWAL_DF_URING", "1") != "0"

    def disable(self) -> None:
        self.enabled = False


_uring = _Uring()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_uring.disable)
_twins: PerObjectCache[lance.LanceDataset, list[lance.LanceDataset | None]] = PerObjectCache()


def _uring_twin(ds: lance.LanceDataset) -> lance.LanceDataset | None:
    """`ds` (a local dataset) at its version opened through the io_uring reader (`file+uring://`:
    for reads only, Lance commits through it without its conditional put); None when `ds` is not
    local or the reader is off or cannot open it."""
    if not _uring.enabled:
        return None
    path = _local_path(str(ds.uri))
    if path is None:
        return None

    def open_twin() -> list[lance.LanceDataset | None]:
        try:
            return [lance.dataset(f"file+uring://{urllib.parse.quote(path)}", version=ds.version)]
        except (OSError, ValueError):
            return [None]

    return _twins.get(ds, open_twin)[0]


def _local_path(uri: str) -> str | None:
    """The absolute path of a dataset URI on the local file system (a path or `file://`), else None."""
    if uri.startswith("/"):
        return uri
    if uri.startswith("file:///"):
        return urllib.parse.unquote(uri[len("file://") :])
    return None


def take_addresses(ds: lance.LanceDataset, addresses: np.ndarray, columns: Sequence[str]) -> pa.Table:
    """The live rows at row `addresses` (`_rowaddr`: fragment id << 32 | physical offset), in that
    order. A fragment without a deletion file (physical offsets are visible offsets) is read through
    its kept `FragmentSession` (the cheaper read), all others through one `_take_rows`."""
    addresses = np.asarray(addresses, dtype=np.uint64)
    whole = _whole.get(
        ds, lambda: {f.fragment_id: f.metadata.deletion_file is None for f in ds.get_fragments()}
    )
    fragments = (addresses >> np.uint64(32)).astype(np.int64)
    order = np.argsort(addresses, kind="stable")
    pieces: dict[int, pa.Table] = {}
    rest: list[tuple[int, np.ndarray]] = []  # taken in one `_take_rows` (a call costs ~0.5 ms)
    for fragment in np.unique(fragments).tolist():
        at = addresses[order[fragments[order] == fragment]]
        if whole.get(fragment, False) and len(np.unique(at)) == len(at):
            pieces[fragment] = fragment_take(ds, fragment, at & np.uint64(0xFFFFFFFF), columns)
        else:
            rest.append((fragment, at))
    if rest:
        taken = ds._take_rows(
            pa.array(np.concatenate([at for _, at in rest]), pa.uint64()), columns=list(columns)
        )
        start = 0
        for fragment, at in rest:  # rows come back in address order
            pieces[fragment] = taken.slice(start, len(at))
            start += len(at)
    parts = [pieces[f] for f in sorted(pieces)]
    if not parts:
        return pa.Table.from_batches([], schema=projected_schema(ds.schema, columns))
    taken = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
    if taken.num_rows != len(addresses):
        raise NotFoundError(f"{len(addresses) - taken.num_rows} of the rows taken by address are gone")
    return taken.take(pa.array(np.argsort(order)))
