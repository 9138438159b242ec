"""Region specs: how rows map to regions and how filters prune them (Lance 14 "sharding specs").

The public API is re-exported here: the builders (`bucket`, `identity`, ...) and the spec classes.
Modules: `spec` (fields, specs, builders), `transforms` (the well-known transforms),
`sql_expression` (SQL expressions, evaluated by `intexpr` where it can), `predicates` (what pruning
projects) and `values` (result types and the region value codec). Code inside memwal_df imports
the submodule.
"""

from memwal_df.format.regions.spec import (
    RegionField,
    RegionSpec,
    UnboundRegionField,
    UnboundRegionSpec,
    bucket,
    day,
    expression,
    hour,
    identity,
    month,
    multi_bucket,
    truncate,
    unsharded,
    year,
)

__all__ = [
    "RegionField",
    "RegionSpec",
    "UnboundRegionField",
    "UnboundRegionSpec",
    "bucket",
    "day",
    "expression",
    "hour",
    "identity",
    "month",
    "multi_bucket",
    "truncate",
    "unsharded",
    "year",
]
