"""The read path. The way in: `dataset.MemWalTable` (the table DataFusion scans) and `sql` (`register`,
`query`: memwal_df's SQL functions). Below them, one folder per kind of query, each with its planner
and its operators, over a shared core:

* `search/` (`vector/`, `fts/`): `vector_search` and `fts` over every level;
* `scan/`: full and filtered scans; `lookup/`: point lookups and the writer's current-row lookup;
* `changes`: the change feed of flushed generations;
* `lsm/`: the read snapshot, its levels, primary keys, the base key index, fragment takes, caches;
* `expr/`: pushed filter expressions; `exec/`: the generic operators (interface, union, filter).

Within `read`, a folder imports only the ones listed after it (`lsm` may import `exec` and `expr`).
May import: `memwal_df.format`, `memwal_df.write` (a writer's MemTables and newest rows, its FTS
postings), `memwal_df.errors`, `memwal_df.pools`. Never imports `jobs`.
"""
