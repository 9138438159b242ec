"""The write path: MemTables and their indexes, generation flushes, region writers and routing.

A `RegionWriter` claims one region (epoch fencing), appends each write to the region's WAL, keeps
it in a MemTable and flushes sealed MemTables as generations; a `TableWriter` routes rows to region
writers by the table's region spec.

May import: `memwal_df.format`, `memwal_df.errors`, `memwal_df.pools`. Never imports `read` or `jobs`.
"""
