"""Parent side of `tests/support/job_child.py`: start a child, read a writer child's acknowledgement log, and
the peak memory of a child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import memwal_df

CHILD = Path(__file__).with_name("job_child.py")
# The child imports the memwal_df under test (this process's), not another one installed in the venv.
SOURCE_ROOT = str(Path(memwal_df.__file__).resolve().parents[1])


def spawn(
    mode: str, uri: str, options: dict[str, str] | None, log_dir: Path, **args: Any
) -> subprocess.Popen:
    """Start `job_child.py MODE` (stdout piped: it prints `ready`; stderr to a file in `log_dir`)."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": SOURCE_ROOT + (os.pathsep + path if path else "")}
    stderr_path = log_dir / f"{mode}-{time.monotonic_ns()}.stderr"
    with open(stderr_path, "wb") as err:
        p = subprocess.Popen(
            [sys.executable, "-u", str(CHILD), mode, uri, json.dumps(options), json.dumps(args)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    p.stderr_path = stderr_path  # type: ignore[attr-defined]
    return p


def close_process(proc: subprocess.Popen) -> None:
    """Kill `proc` if it still runs, reap it and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


def stderr_tail(p: subprocess.Popen, lines: int = 30) -> str:
    """The last `lines` lines a child started by `spawn` wrote to its stderr file."""
    return "\n".join(p.stderr_path.read_text(errors="replace").splitlines()[-lines:])  # type: ignore[attr-defined]


def wait_ready(*procs: subprocess.Popen) -> None:
    for p in procs:
        assert isinstance(p.args, list)
        assert p.stdout is not None and p.stdout.readline() == "ready\n", f"child {p.args[3]} died"


def read_log(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(acknowledged ops in order, ops in flight) from a writer child's log; a torn last line (the
    child was killed while writing it) is ignored."""
    intents: dict[int, dict[str, Any]] = {}
    acked: list[int] = []
    for line in path.read_text().splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "intent" in msg:
            intents[msg["intent"]] = msg
        else:
            acked.append(msg["ack"])
    assert acked == list(range(len(acked))), "acknowledgements out of order"
    in_flight = [intents[i] for i in sorted(intents) if i >= len(acked)]
    assert len(in_flight) <= 1
    return [intents[i] for i in acked], in_flight


def op_rows(op: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows (with `_tombstone`) of a logged op."""
    if op["op"] == "put":
        return [{"id": k, "v": v, "_tombstone": False} for k, v in op["rows"]]
    return [{"id": k, "v": None, "_tombstone": True} for k in op["keys"]]


def peak_rss_mb(pid: int) -> float | None:
    """The peak resident set size (VmHWM) of a process, in MiB; None once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None  # a zombie: exited, not yet reaped
