"""Generated protobuf code; regenerate with `make protos`."""
