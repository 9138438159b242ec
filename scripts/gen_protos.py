"""Regenerate memwal_df/format/proto/memwal_pb2.py from protos/memwal.proto (run by `make protos`)."""

from __future__ import annotations

import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "memwal_df" / "format" / "proto"


def main() -> int:
    OUT.mkdir(exist_ok=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{ROOT / 'protos'}",
            f"-I{include}",
            f"--python_out={OUT}",
            f"--pyi_out={OUT}",
            "memwal.proto",
        ]
    )
    (OUT / "__init__.py").write_text('"""Generated protobuf code; regenerate with `make protos`."""\n')
    return rc


if __name__ == "__main__":
    sys.exit(main())
