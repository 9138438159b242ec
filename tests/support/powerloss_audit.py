"""The fsync audit: at every publish of a recorded run (`tests/support/powerloss.py`), is every file
it may depend on durable?

A **publish** makes something visible that readers, writers or later jobs rely on after a power
loss:
* a **Lance version**: a rename or link of `N.manifest` into the base table's `_versions/` (every
  commit memwal_df makes through Lance, the MemWAL index commits included). A generation's own
  `_versions/` is not one: a generation is published by the region manifest that lists it;
* a **region manifest** (`_mem_wal/{region}/manifest/*.binpb`), a **WAL entry**
  (`_mem_wal/{region}/wal/*`), or another file memwal_df publishes under `_mem_wal/` outside
  generation directories (quarantined WAL entries, the entry lease, the job error record, ...);
* a **GC deletion**: an unlink or rmdir under `_mem_wal/{region}/` (merged generations, WAL
  entries, old region manifests);
* a **writer lease** change (`_mem_wal/_writer_leases/{region}/`: a writer takes, renews or releases
  its region's lease, deleting older epochs), scoped to that region;
* a **version cleanup deletion**: an unlink in the base table's `_versions/`, `data/`,
  `_deletions/`, `_transactions/` or `_indices/` (not Lance's temp names `*#N`, `.tmp*`);
* the **return** of a memwal_df call (the workload's `DONE` line) or of an acknowledged put or
  delete (its `ACK` line): after every base commit memwal_df makes, the files it changed are synced
  before the call returns, and an acknowledged write is durable.

**Rule.** At a publish, every file the traced process wrote or named earlier under the same table
directory and that still exists must be durable: its bytes fsynced (or fdatasynced) after its last
write, the directory entry of each of its names fsynced after the entry was made, and so for every
directory made in the run on the way to it. Exceptions:
* at a Lance version publish, the files of the same outermost Lance call (the workload announces
  each call into pylance): Lance writes them without fsync, memwal_df syncs them after the call and
  recovery rolls back a newest version whose files did not survive. Every file of an earlier call
  must be durable;
* the file being published needs its bytes synced, not yet its new name;
* at a region-scoped publish (region manifest, WAL entry, GC deletion, writer lease of region R), a file in
  another region's directory written by another thread: the writers of two regions run
  concurrently and neither depends on the other (the acknowledgement of a put that spans regions
  is a publish of its own and waits for all of them);
* Lance's `latest_version_hint.json`, which nothing depends on (a torn or missing hint is harmless:
  readers probe past it).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field

from support.powerloss import DATA_OPS, Effect, LanceCall, Recording

EXEMPT_NAMES = ("latest_version_hint.json",)
_BASE_DIRS = ("_versions", "data", "_deletions", "_transactions", "_indices")


def publish_kind(e: Effect) -> str | None:
    """What `e` publishes, or None."""
    if e.kind == "out":
        if e.text.startswith("DONE "):
            return f"return of {e.text.split(' ', 1)[1]}"
        if e.text.startswith("ACK "):
            return f"return of {json.loads(e.text.split(' ', 1)[1])['op']}"
        return None
    if e.workload is None:
        return None
    if e.kind in ("rename", "link"):
        parts = e.path2.split("/")[1:]  # below the workload's table directory
        name = parts[-1]
        if len(parts) == 2 and parts[0] == "_versions" and name.endswith(".manifest"):
            return "Lance version"
        if parts[0] != "_mem_wal" or ".tmp." in name or any("_gen_" in p for p in parts):
            return None
        if parts[1] == "_writer_leases":
            return "writer lease"
        if len(parts) == 4 and parts[2] == "manifest" and name.endswith(".binpb"):
            return "region manifest"
        if len(parts) == 4 and parts[2] == "wal":
            return "WAL entry"
        return None if name == "version_hint.json" else "memwal_df file"
    if e.kind in ("unlink", "rmdir"):
        parts = e.path.split("/")[1:]
        name = parts[-1]
        if "#" in name or name.startswith(".tmp") or ".tmp." in name:
            return None  # Lance's and memwal_df's own temp files
        if parts[0] == "_mem_wal" and len(parts) >= 3:
            return "writer lease" if parts[1] == "_writer_leases" else "GC deletion"
        if parts[0] in _BASE_DIRS:
            return "version cleanup deletion"
    return None


@dataclass
class Unsynced:
    path: str
    why: str  # what is not durable
    by: str  # who wrote it: the Python-level operation and the Lance call


@dataclass
class Violation:
    workload: str
    kind: str
    publish: Effect
    lance_call: str  # the Lance call(s) the publish happened in
    files: list[Unsynced] = field(default_factory=list)

    def format(self, reported: set[tuple[str, str]], limit: int = 12) -> str:
        """The publish and the unsynced files not `reported` at an earlier publish (then added)."""
        where = f" inside {self.lance_call}" if self.lance_call else ""
        new = [u for u in self.files if (self.workload, u.path) not in reported]
        old = len(self.files) - len(new)
        out = [f"[{self.workload}] {self.kind} {self.publish.describe()}{where}: {len(self.files)} unsynced"]
        for u in new[:limit]:
            out.append(f"    {u.path}: {u.why} (written by {u.by})")
        if len(new) > limit:
            out.append(f"    ... and {len(new) - limit} more")
        if old:
            out.append(f"    (and {old} files listed at earlier publishes)")
        reported.update((self.workload, u.path) for u in new)
        return "\n".join(out)


@dataclass
class Audit:
    violations: list[Violation]
    publishes: dict[tuple[str, str], int]  # (workload, kind) -> publishes checked

    def summary(self) -> str:
        counts: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
        for v in self.violations:
            c = counts[(v.workload, v.publish.op or "-", v.kind)]
            c[0] += 1
            c[1] += len(v.files)
        return "\n".join(
            f"  {w}: in {op!r}, {n} {k} publish(es) over unsynced files ({files} file dependencies)"
            for (w, op, k), (n, files) in sorted(counts.items())
        )

    def report(self, limit: int = 60) -> str:
        total = sum(self.publishes.values())
        out = [
            f"{len(self.violations)} of {total} publishes depend on files that were not synced:",
            self.summary(),
            "",
        ]
        reported: set[tuple[str, str]] = set()
        out += [v.format(reported) for v in self.violations[:limit]]
        if len(self.violations) > limit:
            out.append(f"... and {len(self.violations) - limit} more publishes")
        return "\n".join(out)


_REGION_SCOPED = ("region manifest", "WAL entry", "GC deletion", "writer lease")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _region_of_path(path: str) -> str | None:
    """The region a path is in (workload/_mem_wal/{region}/... or a writer lease,
    workload/_mem_wal/_writer_leases/{region}/...), or None."""
    parts = path.split("/")
    if len(parts) > 3 and parts[1] == "_mem_wal" and _UUID.fullmatch(parts[2]):
        return parts[2]
    if len(parts) > 4 and parts[1:3] == ["_mem_wal", "_writer_leases"] and _UUID.fullmatch(parts[3]):
        return parts[3]
    return None


def _region(e: Effect) -> str | None:
    return _region_of_path(e.path2 if e.kind in ("rename", "link") else e.path)


def _windows(calls: list[LanceCall], line: int) -> list[LanceCall]:
    return [c for c in calls if c.begin < line < c.end]


def _describe_call(calls: list[LanceCall], line: int) -> str:
    inside = _windows(calls, line)
    return " / ".join(f"{c.name} from {c.caller}" for c in inside)


def audit(rec: Recording) -> Audit:
    entries = {d: dict(c) for d, c in rec.base.entries.items()}
    made: dict[tuple[int, str], Effect] = {}  # a name made in the run -> the effect that made it
    last_data: dict[int, Effect] = {}
    touched: dict[int, Effect] = {}  # inode -> the last effect that wrote it or gave it a name
    names: dict[int, set[tuple[int, str]]] = defaultdict(set)
    for d, children in entries.items():
        for name, ino in children.items():
            names[ino].add((d, name))
    parent_of_dir: dict[int, tuple[int, str]] = {}
    for d, children in entries.items():
        for name, ino in children.items():
            if ino in entries:
                parent_of_dir[ino] = (d, name)
    violations: list[Violation] = []
    publishes: dict[tuple[str, str], int] = defaultdict(int)

    def path(d: int, name: str) -> str:
        parts = [name]
        while d in parent_of_dir:
            d, n = parent_of_dir[d]
            parts.append(n)
        return "/".join(reversed(parts))

    def by(e: Effect) -> str:
        call = _describe_call(rec.lance_calls, e.end)
        return f"op {e.op or '-'}" + (f", {call}" if call else "")

    def check(e: Effect, kind: str) -> None:
        workload = e.workload
        publishes[(workload or "", kind)] += 1
        same_call = _windows(rec.lance_calls, e.end) if kind == "Lance version" else []
        published = e.ino if e.kind in ("rename", "link") else None
        region = _region(e) if kind in _REGION_SCOPED else None
        found = []
        for ino, last in touched.items():
            current = names.get(ino)
            if not current or ino in entries:  # gone, or a directory
                continue
            if last.workload != workload or all(n in EXEMPT_NAMES for _, n in current):
                continue
            if any(c.begin < last.end < c.end for c in same_call):
                continue  # written by the same Lance call as the version it publishes
            if region is not None and last.tid != e.tid:
                other = {_region_of_path(path(d, n)) for d, n in current} - {None}
                if other and region not in other:
                    continue  # another region's file, written concurrently by another thread
            whys = []
            data = last_data.get(ino)
            if data is not None and data.durable_at >= e.index:
                whys.append(f"bytes of {data.describe()} not fsynced")
            for d, name in sorted(current):
                if ino == published:
                    break  # its old name goes, the new one is what is being published
                chain_d, chain_name = d, name
                while True:
                    maker = made.get((chain_d, chain_name))
                    if maker is not None and maker.durable_in.get(chain_d, float("inf")) >= e.index:
                        entry = path(chain_d, chain_name)
                        whys.append(
                            f"entry {entry} ({maker.kind} #{maker.index}) not fsynced in its directory"
                        )
                    if chain_d not in parent_of_dir:
                        break
                    chain_d, chain_name = parent_of_dir[chain_d]
            if whys:
                found.append(Unsynced(path(*sorted(current)[0]), "; ".join(whys), by(last)))
        if found:
            violations.append(
                Violation(workload or "", kind, e, _describe_call(rec.lance_calls, e.end), found)
            )

    for e in rec.effects:
        kind = publish_kind(e)
        if kind is not None:
            check(e, kind)
        if e.kind in DATA_OPS:
            last_data[e.ino] = e  # type: ignore[index]
            touched[e.ino] = e  # type: ignore[index]
        elif e.kind in ("create", "link", "mkdir"):
            entries.setdefault(e.dir, {})[e.name] = e.ino  # type: ignore[arg-type,assignment,index]
            names[e.ino].add((e.dir, e.name))  # type: ignore[arg-type,index]
            made[(e.dir, e.name)] = e  # type: ignore[index]
            touched[e.ino] = e  # type: ignore[index]
            if e.kind == "mkdir":
                entries.setdefault(e.ino, {})  # type: ignore[arg-type]
                parent_of_dir[e.ino] = (e.dir, e.name)  # type: ignore[assignment,index]
        elif e.kind == "rename":
            entries[e.dir].pop(e.name, None)  # type: ignore[arg-type,index]
            names[e.ino].discard((e.dir, e.name))  # type: ignore[index]
            old = entries.setdefault(e.dir2, {}).get(e.name2)  # type: ignore[arg-type]
            if old is not None:
                names[old].discard((e.dir2, e.name2))
            entries[e.dir2][e.name2] = e.ino  # type: ignore[assignment,index]
            names[e.ino].add((e.dir2, e.name2))  # type: ignore[arg-type,index]
            made[(e.dir2, e.name2)] = e  # type: ignore[index]
            touched[e.ino] = e  # type: ignore[index]
            if e.ino in entries:
                parent_of_dir[e.ino] = (e.dir2, e.name2)  # type: ignore[assignment]
        elif e.kind in ("unlink", "rmdir"):
            entries[e.dir].pop(e.name, None)  # type: ignore[arg-type,index]
            names[e.ino].discard((e.dir, e.name))  # type: ignore[index]
            made.pop((e.dir, e.name), None)  # type: ignore[arg-type]
    return Audit(violations, dict(publishes))
