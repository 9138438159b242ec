"""Maintained indexes on a flushed generation: each base index a writer maintains, built on the
generation dataset with Lance's own `create_index` / `create_scalar_index` (same name, centroids,
codebook, metric, tokenizer as resolved in `memwal_df.format.maintained_indexes`), so Lance (and
its `LsmVectorSearchPlanner`) opens them as ordinary indexes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import lance

from memwal_df.format.maintained_indexes import MaintainedIndex, ScalarIndexType
from memwal_df.format.rows import TOMBSTONE


def write_generation_indexes(
    uri: str, indexes: Sequence[MaintainedIndex], storage_options: dict[str, str] | None
) -> None:
    """Build every maintained index on the generation dataset at `uri` (one new version each). A
    vector index is skipped when the generation has no live vector (Lance cannot build it on none);
    readers search such a generation without an index."""
    if not indexes:
        return
    ds = lance.dataset(uri, storage_options=storage_options)
    for index in indexes:
        if index.kind == "vector":
            assert index.centroids is not None
            live = ds.count_rows(filter=f"NOT {TOMBSTONE} AND {_quoted(index.column)} IS NOT NULL")
            if live == 0:
                continue
            extra: dict[str, Any] = {}
            if index.codebook is not None:
                extra = {"pq_codebook": index.codebook, "num_sub_vectors": index.codebook.shape[0]}
            ds = ds.create_index(
                index.column,
                index.index_type,
                name=index.name,
                metric=index.metric or "l2",
                num_partitions=len(index.centroids),
                ivf_centroids=index.centroids,
                storage_options=storage_options,
                **extra,
            )
        else:
            params = index.params if index.kind == "inverted" else {}
            index_type = cast(ScalarIndexType, index.index_type)  # the kind is not "vector"
            ds.create_scalar_index(index.column, index_type, name=index.name, **params)


def _quoted(column: str) -> str:
    return "`" + column.replace("`", "``") + "`"
