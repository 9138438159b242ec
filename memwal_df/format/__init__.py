"""The bytes on storage: everything memwal_df reads or writes, in the formats Lance 14 uses.

Owns the storage backends and the table layout, the WAL entry codec and the row model (`rows`), region
manifests, the base table's manifest and MemWAL index entry, region specs and their transforms, region
snapshots, bloom filters, primary-key indexes, leases, the generated protobuf messages, and the table
handle (`TableHandle`: a table as every writer, reader and job reads it).

May import: `memwal_df.errors`, `memwal_df.pools` and other `format` modules. Nothing here knows about
writers, readers or jobs.
"""
