"""A MemWAL table on S3: Lance storage options go to `create_table` / `open_table` / `MemWalTable`
and to the command line (`memwal ... -o KEY=VALUE`). Without an endpoint this example starts a local
S3-compatible server (moto, from the project's test dependencies) and stops it afterwards; without
moto installed it says so and exits 0.

Usage: python examples/s3.py [--endpoint URL --bucket NAME]   (credentials from AWS_* variables)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator

import datafusion
import pyarrow as pa

import memwal_df as mw
from memwal_df.cli import main as memwal


@contextlib.contextmanager
def local_s3() -> Iterator[str]:
    """A moto S3 server on a free port of 127.0.0.1 (its endpoint URL), stopped on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        for _ in range(300):
            try:
                opener.open(endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


def run(endpoint: str, bucket: str, create_bucket: bool) -> int:
    options = {
        "aws_endpoint": endpoint,
        "aws_access_key_id": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        "aws_secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
        "aws_region": os.environ.get("AWS_REGION", "us-east-1"),
        "allow_http": str(endpoint.startswith("http://")).lower(),
    }
    if create_bucket:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=options["aws_access_key_id"],
            aws_secret_access_key=options["aws_secret_access_key"],
            region_name=options["aws_region"],
        ).create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/memwal-example-{uuid.uuid4().hex[:8]}"
    schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
    table = mw.create_table(uri, schema, "id", region_spec=mw.bucket("id", 2), storage_options=options)
    with table.writer() as w:
        w.put(pa.table({"id": pa.array(range(100), pa.int64()), "v": [f"v{i}" for i in range(100)]}))
        w.delete([0, 1])
    table.merge()

    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable(uri, storage_options=options))
    n = ctx.sql("SELECT count(*) AS n, min(id) AS lo FROM t").to_pylist()
    print(f"{uri}: {n}")
    flags = [a for k, v in options.items() for a in ("-o", f"{k}={v}")]
    print("the same from the command line: memwal status", uri, " ".join(flags))
    code = memwal(["status", uri, *flags])
    return 0 if n == [{"n": 98, "lo": 2}] and code == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A MemWAL table on S3.")
    p.add_argument("--endpoint", help="S3 endpoint URL (default: start a local moto server)")
    p.add_argument("--bucket", help="an existing bucket (default with the local server: a new one)")
    args = p.parse_args(argv)
    if args.endpoint:
        if not args.bucket:
            p.error("--bucket is required with --endpoint")
        return run(args.endpoint, args.bucket, create_bucket=False)
    if importlib.util.find_spec("moto") is None:
        print("skipped: no --endpoint given and moto is not installed (pip install 'moto[server]')")
        return 0
    with local_s3() as endpoint:
        return run(endpoint, f"memwal-example-{uuid.uuid4().hex[:8]}", create_bucket=True)


if __name__ == "__main__":
    sys.exit(main())
