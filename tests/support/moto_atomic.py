"""Run `moto_server` with conditional writes made atomic, as they are on S3.

moto checks `If-None-Match: *` and then stores the object in two steps, without a lock, on a threaded
HTTP server: two conditional PUTs of one key that arrive together can both succeed. S3 guarantees
that exactly one does, and the manifest and claim protocols rely on that guarantee. This launcher
serializes moto's object writes (PUT and the multipart-completing POST) behind one lock, so that the
S3 tests exercise the protocol against the semantics S3 documents. Everything else is moto's own.

Usage: `python tests/support/moto_atomic.py [moto_server arguments]`.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from moto.s3.responses import S3Response
from moto.server import main

_WRITES = threading.Lock()


def _serialized(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _WRITES:
            return method(*args, **kwargs)

    return locked


def install() -> None:
    """Make moto's object writes atomic with respect to each other (idempotent)."""
    for name in ("put_object", "_key_response_post"):
        method = getattr(S3Response, name)
        if not getattr(method, "_memwal_serialized", False):
            locked = _serialized(method)
            locked._memwal_serialized = True  # type: ignore[attr-defined]
            setattr(S3Response, name, locked)


if __name__ == "__main__":
    install()
    main(sys.argv[1:])
