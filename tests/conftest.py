"""Shared fixtures: a real S3-compatible server (moto, on 127.0.0.1) and table URIs on both backends.

* `s3_server` (session): starts `moto_server` as a subprocess on a free port, yields its endpoint URL.
* `s3_bucket` (session): a bucket created on that server for this test session.
* `s3_storage_options`: Lance-style `storage_options` for that server (a fresh dict per test).
* `table_uri`: a fresh table URI, parametrized over "local" and "s3" (the latter marked `s3`).
* `table_storage_options`: the options that go with `table_uri` (None for local).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_S3_KEY_ID = "testing"
_S3_SECRET = "testing"
_S3_REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_command(port: int) -> list[str]:
    """moto_server through `support/moto_atomic.py`, which makes its conditional writes atomic as on S3."""
    launcher = Path(__file__).with_name("support") / "moto_atomic.py"
    return [sys.executable, str(launcher), "-H", "127.0.0.1", "-p", str(port)]


def _answers(endpoint: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        with opener.open(endpoint + "/moto-api/", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server (a real process) on 127.0.0.1; yields its endpoint URL."""
    log_path = tmp_path_factory.mktemp("moto") / "moto_server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    last_error = "did not start"
    for _ in range(3):  # the free port can be taken between probing and binding: retry
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                _moto_command(port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None and not _answers(endpoint):
            time.sleep(0.05)
        if proc.poll() is None and _answers(endpoint):
            break
        proc.kill()
        proc.wait()
        last_error = log_path.read_text(errors="replace")[-2000:]
    else:
        raise RuntimeError(f"moto_server did not start: {last_error}")
    try:
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def s3_bucket(s3_server: str) -> str:
    """A bucket created on the moto server for this session (tables use fresh prefixes inside it)."""
    import boto3

    name = f"memwal-test-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_server,
        aws_access_key_id=_S3_KEY_ID,
        aws_secret_access_key=_S3_SECRET,
        region_name=_S3_REGION,
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_storage_options(s3_server: str, s3_bucket: str) -> dict[str, str]:
    """Lance-style storage_options for the moto server (the same dict works for pylance and memwal_df)."""
    return {
        "aws_endpoint": s3_server,
        "aws_access_key_id": _S3_KEY_ID,
        "aws_secret_access_key": _S3_SECRET,
        "aws_region": _S3_REGION,
        "allow_http": "true",
    }


@pytest.hookimpl(tryfirst=True)  # before the `-m` deselection
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`@pytest.mark.slow_on_s3`: the test's S3 twin is `slow` (its local twin runs by default)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.get_closest_marker("slow_on_s3") and params.get("table_uri") == "s3":
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def table_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh table URI: local → `tmp_path / "t"`, s3 → `s3://{bucket}/{uuid}` on the moto server."""
    if request.param == "local":
        return str(tmp_path / "t")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/{uuid.uuid4()}"


@pytest.fixture
def table_storage_options(request: pytest.FixtureRequest, table_uri: str) -> dict[str, str] | None:
    """The storage_options that go with `table_uri` (None for local paths)."""
    if table_uri.startswith("s3://"):
        return request.getfixturevalue("s3_storage_options")
    return None
