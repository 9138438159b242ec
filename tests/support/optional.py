"""`not_none`: a value a test expects to be there (a manifest, a region's status, a WAL entry …), as
its type without None; an AssertionError where it is missing."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def not_none(value: T | None) -> T:
    assert value is not None
    return value
