"""Full scans: region pruning, one partition per region and base span, and their operators
(deduplication of a region's levels, the base rows newer levels shadow, index catch-up)."""
