"""memwal_df is a typed package (PEP 561) as a user installs it: the wheel built from this tree
ships `py.typed`, and mypy run on a user's script that imports the installed wheel checks calls
against memwal_df's annotations (a wrong argument type is an error) and infers memwal_df's types
for what they return (not `Any`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import memwal_df as mw

ROOT = Path(__file__).resolve().parent.parent

USER_SCRIPT = textwrap.dedent(
    """\
    import datafusion
    import pyarrow as pa  # type: ignore[import-untyped]

    import memwal_df as mw

    schema = pa.schema([("id", pa.int64()), ("v", pa.float64())])
    table = mw.create_table("/tmp/t", schema, primary_key="id", region_spec=mw.bucket("id", "four"))
    reveal_type(table)
    with table.writer(durable=True) as w:
        reveal_type(w)
        w.put({"id": [1], "v": [0.5]})
        reveal_type(w.insert_if_absent({"id": [2], "v": [1.5]}))
    with mw.open_table("/tmp/t").region_writer(values=[0]) as rw:
        reveal_type(rw)
    reveal_type(table.merge())
    reveal_type(table.gc())
    reveal_type(table.changes())
    reveal_type(table.maintain(max_rounds=1)[0])
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", mw.MemWalTable("/tmp/t", writer=w))
    """
)
# What each reveal_type in the script shows, in order.
REVEALED = [
    mw.Table,
    mw.TableWriter,
    mw.Applied,
    mw.RegionWriter,
    mw.MergeResult,
    mw.GcResult,
    mw.ChangeFeed,
    mw.Round,
]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel built from a copy of this tree, a directory it is installed into)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "memwal_df", src / "memwal_df", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp / "dist").glob("memwal_df-*.whl")
    site = tmp / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    return wheel, site


def test_the_wheel_ships_py_typed_and_the_protobuf_stub(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "memwal_df/py.typed" in names
    assert "memwal_df/format/proto/memwal_pb2.pyi" in names


def test_mypy_checks_a_user_script_against_memwal_df_annotations(installed, tmp_path):
    _, site = installed
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n")  # mypy's defaults, not this repository's [tool.mypy]
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    env["PYTHONPATH"] = str(site)  # where mypy finds memwal_df: as a package installed there
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            script.name,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert errors == [
        'user.py:7: error: Argument 2 to "bucket" has incompatible type "str"; expected "int"  [arg-type]'
    ], out
    revealed = re.findall(r'Revealed type is "([^"]*)"', out)
    assert revealed == [f"{cls.__module__}.{cls.__qualname__}" for cls in REVEALED], out
    assert result.returncode == 1
