"""Row takes from fragments (`memwal_df.read.lsm.fragments`): the rows asked, in order, whichever reader
serves them. On Linux a local dataset is read through Lance's io_uring reader; where io_uring is
refused (here: Lance started with no ring threads, as a process under a seccomp profile that blocks
io_uring gets), the take still returns the rows and the process uses the default reader from then
on; `MEMWAL_DF_URING=0` turns the io_uring reader off. Each case runs in a child process, which
reports whether it holds an io_uring instance (`/proc/self/fd`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from support.children import SOURCE_ROOT

from memwal_df.read.lsm import fragments

CHILD = """
import json, os, sys
import lance, numpy as np, pyarrow as pa
from memwal_df.read.lsm.fragments import fragment_take, take_addresses
from test_fragment_takes import holds_io_uring

ds = lance.dataset(sys.argv[1])
offsets = np.array(json.loads(sys.argv[2]), np.int64)
first = fragment_take(ds, 0, offsets, ["id", "text"]).to_pylist()
again = fragment_take(ds, 0, offsets, ["id", "text"]).to_pylist()
by_address = take_addresses(ds, offsets[::-1].astype(np.uint64), ["text"]).to_pylist()
print(json.dumps({"first": first, "again": again, "by_address": by_address, "uring": holds_io_uring()}))
"""


def holds_io_uring() -> bool:
    """Whether this process holds an io_uring instance (an open `anon_inode:[io_uring]`)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "io_uring" in os.readlink(f"/proc/self/fd/{fd}"):
                return True
        except OSError:  # closed meanwhile (the listing's own descriptor, say)
            continue
    return False


def make_dataset(path: Path) -> tuple[str, list[dict[str, Any]]]:
    rows = [{"id": i, "text": f"row {i} " + "x" * (i % 7)} for i in range(5000)]
    lance.write_dataset(pa.Table.from_pylist(rows), str(path))
    return str(path), rows


def take_in_child(uri: str, offsets: list[int], **env: str) -> dict[str, Any]:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([SOURCE_ROOT, str(Path(__file__).parent)]), **env}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, uri, json.dumps(offsets)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


OFFSETS = [0, 3, 17, 999, 1000, 4321, 4999]


@pytest.mark.parametrize("name", ["plain", "with space", "per%41cent"])
@pytest.mark.parametrize(
    ("env", "uring"),
    [
        ({}, sys.platform == "linux"),
        ({"LANCE_URING_THREAD_COUNT": "0"}, False),  # io_uring refused: the default reader takes over
        ({"MEMWAL_DF_URING": "0"}, False),
    ],
    ids=["default", "refused", "off"],
)
def test_takes_return_the_rows_asked_through_either_reader(
    tmp_path: Path, name: str, env: dict[str, str], uring: bool
) -> None:
    uri, rows = make_dataset(tmp_path / name)
    got = take_in_child(uri, OFFSETS, **env)
    want = [rows[i] for i in OFFSETS]
    assert got["first"] == want and got["again"] == want
    assert got["by_address"] == [{"text": r["text"]} for r in reversed(want)]
    assert got["uring"] is uring


def test_takes_through_a_file_uri(tmp_path: Path) -> None:
    uri, rows = make_dataset(tmp_path / "d")
    got = take_in_child(Path(uri).as_uri(), OFFSETS)
    assert got["first"] == [rows[i] for i in OFFSETS]
    assert got["uring"] is (sys.platform == "linux")


def test_a_take_of_rows_that_are_gone_raises_with_either_reader(tmp_path: Path) -> None:
    """A take whose files were removed raises (callers read a newer version then), and does not turn
    the io_uring reader off for the takes that can be read."""
    uri, rows = make_dataset(tmp_path / "d")
    ds = lance.dataset(uri)
    for data_file in (Path(uri) / "data").iterdir():
        data_file.unlink()
    with pytest.raises((OSError, ValueError)):
        fragments.fragment_take(ds, 0, np.array([1, 2], np.int64), ["id"])
    other, other_rows = make_dataset(tmp_path / "e")
    got = fragments.fragment_take(lance.dataset(other), 0, np.array([5], np.int64), ["id", "text"])
    assert got.to_pylist() == [other_rows[5]]
    if sys.platform == "linux" and os.environ.get("MEMWAL_DF_URING", "1") != "0":
        assert holds_io_uring()  # still read through io_uring


FORKING = """
import json, sys, multiprocessing as mp
import lance, numpy as np
from memwal_df.read.lsm.fragments import fragment_take

first, second = lance.dataset(sys.argv[1]), lance.dataset(sys.argv[2])
parent = fragment_take(first, 0, np.array([1, 2]), ["id"]).to_pylist()

def child(queue):
    queue.put([fragment_take(first, 0, np.array([3]), ["id"]).to_pylist(),
               fragment_take(second, 0, np.array([4]), ["id"]).to_pylist()])

context = mp.get_context("fork")
queue = context.Queue()
process = context.Process(target=child, args=(queue,))
process.start()
process.join(60)
alive = process.is_alive()
if alive:
    process.kill()
got = queue.get(timeout=5) if process.exitcode == 0 else None
print(json.dumps({"parent": parent, "child": got, "exitcode": process.exitcode, "hung": alive}))
"""


def test_a_forked_child_takes_rows_after_its_parent_did(tmp_path: Path) -> None:
    """A child forked after its parent read through io_uring (Lance's io_uring threads stay in the
    parent) takes rows too, from datasets it inherited and from new ones."""
    first, rows = make_dataset(tmp_path / "a")
    second, _ = make_dataset(tmp_path / "b")
    env = {**os.environ, "PYTHONPATH": SOURCE_ROOT}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", FORKING, first, second],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["parent"] == [{"id": 1}, {"id": 2}]
    assert not got["hung"] and got["exitcode"] == 0, out.stderr[-2000:]
    assert got["child"] == [[{"id": rows[3]["id"]}], [{"id": 4}]]
