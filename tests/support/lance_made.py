"""Tables whose MemWAL index was made outside memwal_df, for what memwal_df itself refuses to
create: a region spec over columns outside the primary key.

`lance_made_table` uses pylance alone (`initialize_mem_wal`, e.g. `identity_column=`);
`foreign_spec_table` commits any spec's bytes through the same low-level commit memwal_df uses, as an
implementation without the primary-key rule would (Lance's own initializer has bucket, identity and
unsharded only)."""

from __future__ import annotations

from typing import Any

import lance
import pyarrow as pa

import memwal_df as mw
from memwal_df.format import memwal_index
from memwal_df.format.proto import memwal_pb2 as pb
from memwal_df.format.regions.spec import UnboundRegionSpec, lance_field_ids

PK_META = {"lance-schema:unenforced-primary-key": "true"}


def _write(
    uri: str, data: pa.Table, primary_key: str, storage_options: dict[str, str] | None
) -> lance.LanceDataset:
    """`data` written by pylance with `primary_key` marked as Lance's unenforced primary key."""
    schema = pa.schema(
        [f.with_nullable(False).with_metadata(PK_META) if f.name == primary_key else f for f in data.schema]
    )
    return lance.write_dataset(data.cast(schema), uri, storage_options=storage_options)


def lance_made_table(
    uri: str,
    data: pa.Table,
    primary_key: str,
    storage_options: dict[str, str] | None = None,
    **initialize: Any,
) -> mw.Table:
    """`data` written by pylance, then `initialize_mem_wal(**initialize)`, opened with memwal_df."""
    _write(uri, data, primary_key, storage_options).initialize_mem_wal(**initialize)
    return mw.open_table(uri, storage_options=storage_options)


def foreign_spec_table(
    uri: str,
    data: pa.Table,
    primary_key: str,
    region_spec: UnboundRegionSpec,
    storage_options: dict[str, str] | None = None,
) -> mw.Table:
    """`data` written by pylance, with a MemWAL index holding `region_spec` whatever columns it reads."""
    ds = _write(uri, data, primary_key, storage_options)
    bound = region_spec.bind(lance_field_ids(ds), ds.schema, primary_key=ds.schema.names)  # no key rule
    details = pb.MemWalIndexDetails(sharding_specs=[bound.to_proto()], maintain_all_indexes=True)
    details.num_shards = bound.num_regions or 0
    memwal_index._commit_details(uri, details, ds.version, ds.version, [], storage_options)
    return mw.open_table(uri, storage_options=storage_options)
