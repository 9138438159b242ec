"""Full-text search: BM25 term statistics over the deduplicated table, per-level postings, the base
table's per-fragment term state and the BM25 operators."""
