"""The LSM tree a query reads: the read snapshot (every level, fixed when a query is planned), the
levels (generations, MemTables), primary keys, the base key index, row takes from Lance fragments and
the caches of what never changes. Every kind of query builds on it."""
