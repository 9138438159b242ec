"""Vector search: query vectors and distances, exact brute force (int8 first pass) and Lance's
indexed `nearest`."""
