"""LanceKnnExec: Lance's nearest rows of the base table, or of a large generation through its own index.

Lance's `nearest` with `nprobes` / `refine_factor`, the filter's Lance part as a prefilter (applied
exactly before the search; for a generation with `NOT _tombstone`) and the rest applied to the
results (fetching more until `n` rows match). Rows are taken afterwards by row address.

Guarantees: with a vector index, `top(n)` is Lance's approximate answer (fragments the index does
not cover yet are searched exactly by Lance itself, unless `indexed_only`); without one, the exact
`n` nearest matching rows. A generation's tombstones are never returned.
"""

from __future__ import annotations

from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.format.rows import TOMBSTONE
from memwal_df.read.expr.lance_filter import split_for_lance
from memwal_df.read.expr.predicate import referenced_columns
from memwal_df.read.lsm.fragments import take_addresses
from memwal_df.read.search.ranked import POSITION, grow
from memwal_df.read.search.vector.knn import KnnExec
from memwal_df.read.search.vector.vectors import DISTANCE, KnnQuery

__all__ = ["LanceKnnExec"]

_ROWADDR = "_rowaddr"


class LanceKnnExec(KnnExec):
    """Lance's nearest rows of the base table (through its vector index when it has one)."""

    native = True

    def __init__(
        self,
        base: lance.LanceDataset,
        knn: KnnQuery,
        nprobes: int | None = None,
        refine_factor: int | None = None,
        label: str | None = None,
        *,
        catchup: str | None = None,
        indexed_only: bool = False,
    ) -> None:
        """`label` names a generation (`base` is then its dataset, whose tombstones are skipped);
        `indexed_only`: search only the fragments the vector index covers (Lance's `fast_search`;
        a catch-up plan's gap generations stand in for the others), `catchup` says why, for
        `explain`."""
        super().__init__(knn)
        self.base = base
        self.label = label
        self.catchup = catchup
        self.indexed_only = indexed_only
        keys = [self.table_schema.field(c) for c in self.primary_key]
        self._top_schema = pa.schema([*keys, pa.field(POSITION, pa.int64()), self.schema.field(DISTANCE)])
        self.nprobes = nprobes
        self.refine_factor = refine_factor
        self._last: pa.Table | None = None  # what the last `top` fetched (with row addresses), by position

    def describe(self) -> str:
        f = "" if self.filter is None else f", prefilter={self.filter}"
        return (
            f"LanceKnnExec: {self.label or 'base'} v{self.base.version}, column={self.column}, "
            f"metric={self.metric}, "
            f"nprobes={self.nprobes}, refine_factor={self.refine_factor}{f}"
            + (", indexed fragments only" if self.indexed_only else "")
            + (f", catch-up: {self.catchup}" if self.catchup else "")
        )

    def top(self, n: int) -> pa.Table:
        """Lance's nearest rows: their keys, the columns of the filter's part that Lance cannot
        apply, `_distance` and row addresses only; `rows` takes the winners' other columns."""
        if self.label is None:
            sql, residual = split_for_lance(self.filter, self.table_schema)
        else:
            live = ~pc.field(TOMBSTONE)
            flt = live if self.filter is None else self.filter & live
            sql, residual = split_for_lance(flt, self.table_schema.append(pa.field(TOMBSTONE, pa.bool_())))
        needed = set(self.primary_key) | (referenced_columns(residual) if residual is not None else set())
        columns = [c for c in [*self.table_schema.names, TOMBSTONE] if c in needed]

        def fetch(m: int) -> pa.Table:
            nearest: dict[str, Any] = {"column": self.column, "q": self.query, "k": m, "metric": self.metric}
            if self.nprobes is not None:
                nearest["nprobes"] = self.nprobes
            if self.refine_factor is not None:
                nearest["refine_factor"] = self.refine_factor
            rows = self.base.to_table(
                columns=[*columns, DISTANCE],
                nearest=nearest,
                filter=sql,
                prefilter=sql is not None,
                fast_search=self.indexed_only,
                with_row_address=True,
            )
            self._last = rows
            return rows.append_column(POSITION, pa.array(np.arange(rows.num_rows, dtype=np.int64)))

        def keep(rows: pa.Table) -> pa.Table:
            return rows if residual is None else rows.filter(residual)

        found = grow(fetch, keep, n, n)
        return found.select([*self.primary_key, POSITION, DISTANCE]).cast(self._top_schema)

    def rows(self, positions: np.ndarray) -> pa.Table:
        assert self._last is not None, "top() first"
        addresses = self._last.column(_ROWADDR).to_numpy()[np.asarray(positions, dtype=np.int64)]
        return take_addresses(self.base, addresses, self.table_schema.names)
