"""`open_storage`: the `Storage` for a table URI, on the local file system or on an object store.

It sits above both backends (`local_storage`, `object_storage`), which import `storage` for the
interface they implement.
"""

from __future__ import annotations

import os
import urllib.parse

from memwal_df.errors import StorageError
from memwal_df.format.local_storage import LocalStorage
from memwal_df.format.object_storage import open_object_storage
from memwal_df.format.storage import Storage, option_str

__all__ = ["open_storage"]


def open_storage(uri: str, storage_options: dict[str, str] | None = None) -> Storage:
    """Open the Storage rooted at `uri` (a local path, `file://`, `s3://`, `memory://`, … URI) with
    Lance-style `storage_options`."""
    uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri:
        raise ValueError(f"invalid storage URI {uri!r}")
    options = {str(k): option_str(v) for k, v in (storage_options or {}).items()}
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
    return open_object_storage(uri, options)
