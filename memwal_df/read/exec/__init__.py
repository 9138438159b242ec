"""The generic query operators over Arrow batch streams, one per file: the operator interface, union,
filter, and batches shaped to an operator's output. The operators of each kind of query live with it."""
