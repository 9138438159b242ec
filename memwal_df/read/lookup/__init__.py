"""Point lookups (`pk = x`, `pk IN (...)`): per key the newest level that holds it, bloom-guarded, and
the writer-side lookup of the current rows that partial and conditional writes need."""
