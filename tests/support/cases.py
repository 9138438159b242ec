"""Shared parametrization of the crash, fault and load tests: a table URI on either backend, and a
case list split into a default-suite sample and the `slow` rest."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest


def backend(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> tuple[str, dict[str, str] | None]:
    """(uri, storage_options) of a fresh table: `tmp_path / "t"` or a new prefix on the moto server."""
    if kind == "local":
        return str(tmp_path / "t"), None
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/{uuid.uuid4()}", request.getfixturevalue("s3_storage_options")


def cases(sample: list[tuple[Any, ...]], everything: list[tuple[Any, ...]]) -> list[Any]:
    """`sample` runs in the default suite, the rest of `everything` under `slow`; s3 cases are marked."""
    out = []
    for case in everything:
        marks = [pytest.mark.s3] if case[0] == "s3" else []
        if case not in sample:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(*case, marks=marks, id="-".join(map(str, case))))
    return out
