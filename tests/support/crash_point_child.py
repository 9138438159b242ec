"""A child process for `tests/test_crash_points.py`, killed by strace at an exact system call
(`tests/support/syscall_kill.py`): `python crash_point_child.py`.

It imports memwal_df, prints `ready`, then reads one command (a JSON object) from stdin, so that
the parent can attach strace in between. Every message is one JSON line on stdout, flushed; `done`
ends a run that was not killed. Commands (`uri`, `options` and `op`, plus the op's arguments):

* `claims`: `rounds` times: claim the region of `values` (`claiming` before the call, `claimed` with
  the epoch after it returned), make `writes` durable writes of keys from `keys` (seeded by `seed`:
  puts of one to three rows, one in four a delete; `intent` with the op before the call, `ack` after
  it returned), then abort the writer (`aborting` before the call: stop without flushing, as a crash
  would, and release its lease). `settings` go to the writer (small MemTables make it flush in the
  background, the replayed rows first).
* `recover`: `recovering`, `table.recover()`, then `recovered` with the recovered region ids.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import pyarrow as pa

import memwal_df as mw

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.float64())])


def say(**msg: Any) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def random_op(rng: random.Random, keys: list[int], tag: float) -> dict[str, Any]:
    if rng.random() < 0.25:
        return {"op": "delete", "keys": rng.sample(keys, rng.randint(1, 2))}
    return {
        "op": "put",
        "rows": [[k, tag + j / 10] for j, k in enumerate(rng.sample(keys, rng.randint(1, 3)))],
    }


def apply(writer: Any, op: dict[str, Any]) -> None:
    if op["op"] == "put":
        writer.put(pa.Table.from_pylist([{"id": k, "v": v} for k, v in op["rows"]], schema=SCHEMA))
    else:
        writer.delete(op["keys"])


def claims(table: mw.Table, cmd: dict[str, Any]) -> None:
    rng = random.Random(cmd["seed"])
    n = 0
    for r in range(cmd["rounds"]):
        say(claiming=r)
        writer = table.region_writer(values=cmd["values"], durable=True, **cmd.get("settings", {}))
        say(claimed=r, epoch=writer.epoch)
        for _ in range(cmd["writes"]):
            op = random_op(rng, cmd["keys"], float(cmd["seed"] * 1000 + n))
            say(intent=n, **op)
            apply(writer, op)
            say(ack=n)
            n += 1
        say(aborting=r)
        writer.abort()  # releases the writer's lease of the region
        say(aborted=r)


def main() -> None:
    print("ready", flush=True)
    cmd = json.loads(sys.stdin.readline())
    table = mw.open_table(cmd["uri"], cmd.get("options"))
    if cmd["op"] == "claims":
        claims(table, cmd)
    elif cmd["op"] == "recover":
        say(recovering=True)
        say(recovered=[str(r) for r in table.recover()])
    else:
        raise ValueError(f"unknown op {cmd['op']!r}")
    say(done=True)


if __name__ == "__main__":
    main()
