"""CoalesceFirstExec: per key, the answer of the first input (newest level first) that has the key.

Guarantees:

* For each requested key, the row of the FIRST child (children ordered newest level first) that has
  the key. If that row is a tombstone the key is deleted: nothing is returned for it, and older
  children are not asked for it. A key no child has returns nothing.
* Lazy and short-circuit: children are built and executed one after another, each only for the keys
  still unresolved, and none after every key is resolved. Rows are yielded as soon as their child
  produces them, so a consumer that stops early stops the remaining children too.
* Output: live rows only, at most one per requested key, without `_tombstone`, with the requested
  columns in the requested order (cast to `schema` when one is given).

Children take a keys table and return an operator whose rows carry the key columns and `_tombstone`,
at most one row per key (`TakeLastExec`, possibly behind a `BloomFilterGuardExec`). The keys table
handed to the next child is the same object as long as no key was resolved, so per-table work (bloom
hashes) is shared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.read.exec.base import ExecNode
from memwal_df.read.exec.batches import conform_batch
from memwal_df.read.lsm.keys import TOMBSTONE, distinct_keys, encode_keys

__all__ = ["CoalesceFirstExec"]


class CoalesceFirstExec(ExecNode):
    """For each key, the row from the FIRST child (children ordered newest level first) that has the
    key; a tombstone found first means the key is deleted (nothing returned for it, older children not
    asked for it). Lazy and short-circuit: children are asked one after another only for the keys still
    unresolved, and none after all keys are resolved. Output: live rows only, without _tombstone,
    columns as requested."""

    def __init__(
        self,
        keys: pa.Table,
        children: Sequence[Callable[[pa.Table], ExecNode]],
        primary_key: Sequence[str],
        columns: Sequence[str],
        *,
        label: str = "",
        schema: pa.Schema | None = None,
    ) -> None:
        self.primary_key = list(primary_key)
        self.keys = distinct_keys(keys, self.primary_key)
        self.make_children = list(children)
        self.columns = [c for c in columns if c != TOMBSTONE]
        self.label = label
        if schema is not None and schema.names != self.columns:
            raise ValueError(f"schema columns {schema.names} differ from the requested {self.columns}")
        self.schema = schema
        # Known after execute():
        self._ran: dict[int, ExecNode] = {}  # input position -> the node that ran
        self.children_run = 0
        self.rows_out = 0
        self.keys_deleted = 0

    @property
    def children(self) -> list[ExecNode]:
        """The inputs: after `execute()` the nodes that ran (with what they did), the others as planned."""
        return [self._ran.get(i) or make(self.keys) for i, make in enumerate(self.make_children)]

    def describe(self) -> str:
        head = "CoalesceFirstExec: return_first_non_null"
        if self.label:
            head += f", {self.label}"
        line = f"{head}, inputs={len(self.make_children)}, keys={self.keys.num_rows}"
        if self.children_run:
            line += f", inputs run={self.children_run}, found={self.rows_out}, deleted={self.keys_deleted}"
        return line

    def execute(self) -> Iterator[pa.RecordBatch]:
        unresolved = self.keys
        unresolved_enc = encode_keys(unresolved, self.primary_key)
        for position, make_child in enumerate(self.make_children):
            if unresolved.num_rows == 0:
                return
            child = self._ran[position] = make_child(unresolved)
            self.children_run += 1
            pending = unresolved_enc  # keys of this round not answered yet
            for batch in child.execute():
                encoded = encode_keys(batch, self.primary_key)
                if pending.type != encoded.type:
                    pending = pending.cast(encoded.type)
                first = pc.is_in(encoded, value_set=pending)  # drops keys not asked or already answered
                if first.true_count < len(first):
                    batch, encoded = batch.filter(first), encoded.filter(first)
                if batch.num_rows == 0:
                    continue
                # A child returns each key at most once: answering as many keys as are pending answers all.
                if batch.num_rows == len(pending):
                    pending = pending.slice(0, 0)
                else:
                    pending = pending.filter(pc.invert(pc.is_in(pending, value_set=encoded)))
                yield from self._live(batch)
            if len(pending) == 0:
                return
            if len(pending) < unresolved.num_rows:
                still = pc.is_in(unresolved_enc, value_set=pending.cast(unresolved_enc.type))
                unresolved = unresolved.filter(still)
                unresolved_enc = unresolved_enc.filter(still)

    def _live(self, rows: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
        """The rows that are not tombstones (a NULL `_tombstone` counts as live), as output."""
        if TOMBSTONE in rows.schema.names:
            tombstones = rows.column(TOMBSTONE)
            deleted = tombstones.true_count
            if deleted:
                self.keys_deleted += deleted
                rows = rows.filter(pc.invert(pc.fill_null(tombstones, False)))
        if rows.num_rows:
            self.rows_out += rows.num_rows
            yield conform_batch(rows.select(self.columns), self.schema)
