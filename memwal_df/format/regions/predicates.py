"""Pruning predicates: the conditions on one column that region pruning understands.

`read.predicate` turns pushed-down filters into these; a transform projects a predicate on its source
column onto region values (`Transform.project`), and `RegionSpec.prune` tests region values with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Eq", "In", "Predicate", "Range", "named_values", "same_value"]


def same_value(a: Any, b: Any) -> bool:
    """SQL equality on non-NULL values, with Arrow's NaN == NaN."""
    return bool(a == b or (a != a and b != b))


@dataclass(frozen=True)
class Eq:
    """``column = value``."""

    value: Any

    def test(self, v: Any) -> bool:
        """Whether `v` may satisfy the predicate (NULL never does)."""
        return v is not None and same_value(v, self.value)


@dataclass(frozen=True)
class In:
    """``column IN (values)``; an empty list matches nothing."""

    values: tuple[Any, ...]

    def __init__(self, values: Iterable[Any]) -> None:
        object.__setattr__(self, "values", tuple(values))

    def test(self, v: Any) -> bool:
        """Whether `v` may satisfy the predicate (NULL never does)."""
        return v is not None and any(same_value(v, x) for x in self.values)


@dataclass(frozen=True)
class Range:
    """``lo <(=) column <(=) hi``; a None bound is unbounded."""

    lo: Any = None
    lo_inclusive: bool = True
    hi: Any = None
    hi_inclusive: bool = True

    def test(self, v: Any) -> bool:
        """Whether `v` may satisfy the predicate; incomparable values (NaN, mixed types) may."""
        if v is None:
            return False
        try:
            if any(x is not None and x != x for x in (v, self.lo, self.hi)):
                return True
            if self.lo is not None and (v < self.lo or (v == self.lo and not self.lo_inclusive)):
                return False
            if self.hi is not None and (v > self.hi or (v == self.hi and not self.hi_inclusive)):
                return False
        except TypeError:
            return True
        return True


Predicate = Eq | In | Range


def named_values(pred: Predicate | None) -> list[Any] | None:
    """The values a predicate allows, when it names them (Eq, In, or a one-value Range)."""
    if isinstance(pred, Eq):
        return [pred.value]
    if isinstance(pred, In):
        return list(pred.values)
    if (
        isinstance(pred, Range)
        and pred.lo is not None
        and pred.lo_inclusive
        and pred.hi_inclusive
        and pred.lo == pred.hi
    ):
        return [pred.lo]
    return None
