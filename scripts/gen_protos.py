"""Regenerate memwal_df/format/proto/memwal_pb2.py from protos/memwal.proto, and
memwal_df/server/proto/FlightSql_pb2.py from protos/FlightSql.proto (Apache Arrow's Flight SQL
messages, as published in apache/arrow format/FlightSql.proto), run by `make protos`."""

from __future__ import annotations

import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "memwal_df" / "format" / "proto"
# proto file -> the package its generated module goes to
PROTOS = {"memwal.proto": OUT, "FlightSql.proto": ROOT / "memwal_df" / "serve" / "proto"}


def main() -> int:
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    for name, out in PROTOS.items():
        out.mkdir(exist_ok=True)
        rc = protoc.main(
            [
                "protoc",
                f"-I{ROOT / 'protos'}",
                f"-I{include}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                name,
            ]
        )
        (out / "__init__.py").write_text('"""Generated protobuf code; regenerate with `make protos`."""\n')
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
