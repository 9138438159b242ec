"""Background jobs: the merger (generations into the base table), the MemWAL index builder, base
index catch-up, garbage collection, region repair and the `maintain` loop that runs them.

May import: `memwal_df.format`, `memwal_df.write`, `memwal_df.read`, `memwal_df.errors`,
`memwal_df.pools`. Jobs take a table handle; they never import the `Table` facade.
"""
