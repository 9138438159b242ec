"""Short identifiers for one-line descriptions (`explain`, error messages)."""

from __future__ import annotations

__all__ = ["short_id"]


def short_id(value: object) -> str:
    """The first 8 characters of an id, for one-line descriptions: `1a2b3c4d…`."""
    text = str(value)
    return text if len(text) <= 8 else text[:8] + "\u2026"
