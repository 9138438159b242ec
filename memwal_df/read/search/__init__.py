"""Search over every level: `vector_search` (k nearest) and `fts` (BM25), each level ranked on its
own, stale candidates dropped, global winners fetched; the planner and the ranked operators."""
