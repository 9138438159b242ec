"""The read path: levels, snapshots, predicates, planning for scans, lookups and search, the
`MemWalTable` DataFusion provider and the SQL functions; `read.exec` holds the physical operators.

May import: `memwal_df.format`, `memwal_df.write` (a writer's MemTables are level 0 of a read),
`memwal_df.errors`, `memwal_df.pools`. Never imports `jobs`.
"""
