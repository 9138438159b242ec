"""An `strace -f -y -xx` trace turned into file-system effects (`tests/support/powerloss.py`).

`read_calls` reads the completed calls of a trace: lines of many threads (`<unfinished ...>` /
`resumed>` pairs joined), strings and the paths `-y` decodes as hex (`-xx`). `parse_trace` turns
them into the ordered list of effects on paths under a root (`Effect`): data written at an offset,
a truncation or extension, the creation, link, rename, unlink of a name, mkdir, rmdir, fsync or
fdatasync of a file, fsync of a directory, sync, and the lines the traced process wrote to its
stdout. It keeps its own model of the tree (`Tree`: directory inode -> name -> inode, file inode
-> bytes, starting from the base state) and of every open descriptor (inode, file position,
O_APPEND), so it follows `O_TMPFILE` files linked in by `linkat("/proc/self/fd/N")` or
`AT_EMPTY_PATH`, Lance's `.tmpXXXX` files renamed into place and `X.manifest#1` files hard-linked
and unlinked, and descriptors of files renamed or unlinked while open. A call takes effect at its
completion line (a `close` at its entry: the descriptor number can be reused before it returns); an
fsync or fdatasync makes durable what completed before its entry line (`Effect.durable_at`,
`Effect.durable_in`); `sync_file_range` makes nothing durable. A call the model cannot follow
(`RENAME_EXCHANGE`, a punching `fallocate`, `copy_file_range` into the tree, a descriptor opened
before the trace) raises `RecorderError`.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DIR_OPS = frozenset({"create", "link", "rename", "unlink", "mkdir", "rmdir"})
DATA_OPS = frozenset({"write", "truncate"})


class RecorderError(Exception):
    """The trace holds something the recorder cannot model, or its model disagrees with the disk."""


# ------------------------------------------------------------------------------------ the trace


@dataclass
class Call:
    """One completed system call of the trace: `start` / `end` are the line numbers of its entry and
    completion (equal unless another thread's line came in between)."""

    start: int
    end: int
    tid: int
    name: str
    args: list[str]
    ret: str


_LINE = re.compile(r"(\d+) +(.*)")
_RESUMED = re.compile(r"<\.\.\. (\w+) resumed>(.*)", re.S)
_CALL = re.compile(r"(\w+)\((.*)\)\s+=\s+(.*)", re.S)
_FD = re.compile(r"(-?\d+|AT_FDCWD)(?:<([^>]*)>)?(\(deleted\))?$")
_RET = re.compile(r"(-?\d+)(?:<([^>]*)>)?")
_HEX = re.compile(r"(?:\\x[0-9a-f]{2})*")
_IOV = re.compile(r'iov_base="((?:\\x[0-9a-f]{2})*)"')
_UNFINISHED = " <unfinished ...>"


def unhex(s: str) -> bytes:
    return bytes.fromhex(s.replace("\\x", ""))


def _decoded(s: str | None) -> str | None:
    """A path strace decoded for a descriptor (hex with -xx; a socket or pipe may come as text)."""
    if s is None:
        return None
    return unhex(s).decode(errors="surrogateescape") if _HEX.fullmatch(s) else s


def split_args(s: str) -> list[str]:
    """Top-level comma separated arguments (strings are hex with -xx: no quotes or commas inside)."""
    out: list[str] = []
    cur: list[str] = []
    depth, in_str = 0, False
    for ch in s:
        if in_str:
            in_str = ch != '"'
        elif ch == '"':
            in_str = True
        elif ch in "[{(<":
            depth += 1
        elif ch in "]})>":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if cur:
        out.append("".join(cur).strip())
    return out


def read_calls(trace: Path) -> list[Call]:
    """The completed calls of an `strace -f -y -xx` trace, in the order they took effect."""
    calls: list[Call] = []
    pending: dict[int, tuple[int, str]] = {}
    with open(trace, encoding="ascii", errors="replace") as f:
        for lineno, line in enumerate(f):
            m = _LINE.match(line.rstrip("\n"))
            if not m:
                continue
            tid, rest = int(m.group(1)), m.group(2)
            start = lineno
            if rest.startswith("<..."):
                r = _RESUMED.match(rest)
                if not r or tid not in pending:
                    raise RecorderError(
                        f"trace line {lineno}: a resumed call without its start: {rest[:200]}"
                    )
                start, head = pending.pop(tid)
                rest = head + r.group(2)
            elif rest.endswith(_UNFINISHED):
                pending[tid] = (lineno, rest[: -len(_UNFINISHED)])
                continue
            c = _CALL.match(rest)
            if not c:
                continue  # signals, exits
            calls.append(Call(start, lineno, tid, c.group(1), split_args(c.group(2)), c.group(3)))
    # A descriptor is free again as soon as `close` enters (another thread may get the number back
    # before the close returns): a close takes effect at its entry line, every other call at its
    # completion line.
    calls.sort(key=lambda c: c.start if c.name == "close" else c.end)
    return calls


def fd_arg(token: str) -> tuple[int | None, str | None, bool]:
    """(descriptor or None for AT_FDCWD, the path strace decoded, whether it is `(deleted)`)."""
    m = _FD.match(token)
    if not m:
        raise RecorderError(f"not a descriptor: {token[:200]}")
    fd = None if m.group(1) == "AT_FDCWD" else int(m.group(1))
    return fd, _decoded(m.group(2)), bool(m.group(3))


def str_arg(token: str) -> bytes:
    if not (token.startswith('"') and token.endswith('"')):
        raise RecorderError(f"not a complete string argument: {token[:200]}")
    return unhex(token[1:-1])


def ret_value(ret: str) -> tuple[int, str | None]:
    m = _RET.match(ret)
    if not m:
        return -1, None
    return int(m.group(1)), _decoded(m.group(2))


# ---------------------------------------------------------------------------------- the effects


@dataclass
class Effect:
    """One file-system effect under the recorded root, or a line the workload wrote to stdout."""

    index: int  # position in `Recording.effects`
    start: int  # trace line of the call's entry
    end: int  # trace line of its completion
    kind: str  # write truncate create link rename unlink mkdir rmdir fsync fsync_dir sync out
    workload: str | None
    tid: int = 0  # the thread that made the call
    ino: int | None = None  # the inode written, synced, named or unnamed
    dir: int | None = None  # create/link/mkdir/unlink/rmdir: the directory; rename: the source's
    name: str | None = None
    dir2: int | None = None  # rename: the destination directory and name
    name2: str | None = None
    offset: int = 0  # write: at this offset; truncate: to this size
    data: bytes = b""
    path: str = ""  # relative to the root: the path written / created / removed / the rename source
    path2: str = ""  # rename, link: the destination
    text: str = ""  # out: the line
    syscall: str = ""
    op: str = ""  # the workload's Python-level operation (its last `OP` line)
    durable_at: float = float("inf")  # the effect index from which a power loss keeps this effect
    durable_in: dict[int, float] = field(default_factory=dict)  # directory -> when its change is durable

    def dirs(self) -> tuple[int, ...]:
        """The directories whose entries this effect changes."""
        if self.kind == "rename":
            return (self.dir,) if self.dir == self.dir2 else (self.dir, self.dir2)  # type: ignore[return-value]
        return (self.dir,)  # type: ignore[return-value]

    def describe(self) -> str:
        what = {
            "write": f"write {len(self.data)} B at {self.offset} to {self.path}",
            "truncate": f"truncate {self.path} to {self.offset}",
            "rename": f"rename {self.path} -> {self.path2}",
            "link": f"link {self.path2}",
            "fsync": f"fsync {self.path}",
            "fsync_dir": f"fsync dir {self.path or '.'}",
            "sync": "sync",
            "out": f"stdout {self.text!r}",
        }.get(self.kind, f"{self.kind} {self.path}")
        return f"#{self.index} {what} ({self.syscall}; op {self.op or '-'})"


@dataclass
class _Fd:
    ino: int | None
    pos: int = 0
    append: bool = False


@dataclass
class LanceCall:
    """An outermost call into pylance (`- BEGIN` ... `- END` lines of the run)."""

    number: int
    name: str
    caller: str
    begin: int  # trace line of the BEGIN write
    end: float = float("inf")  # trace line of the END write
    op: str = ""


class Tree:
    """Directory inode -> {name: inode}, file inode -> bytes: the base state, and the model the
    parser keeps of the tree while it reads the trace."""

    def __init__(self) -> None:
        self.entries: dict[int, dict[str, int]] = {0: {}}  # inode 0: the root
        self.content: dict[int, bytearray] = {}
        self.next = 1

    def new(self, kind: str) -> int:
        ino = self.next
        self.next += 1
        if kind == "d":
            self.entries[ino] = {}
        else:
            self.content[ino] = bytearray()
        return ino

    def lookup(self, rel: str) -> int | None:
        ino = 0
        for part in rel.split("/") if rel else ():
            children = self.entries.get(ino)
            if children is None or part not in children:
                return None
            ino = children[part]
        return ino

    @classmethod
    def scan(cls, root: Path) -> Tree:
        tree = cls()
        seen: dict[tuple[int, int], int] = {}

        def walk(directory: Path, ino: int) -> None:
            for entry in sorted(os.scandir(directory), key=lambda e: e.name):
                st = entry.stat(follow_symlinks=False)
                if entry.is_dir(follow_symlinks=False):
                    child = tree.new("d")
                    walk(Path(entry.path), child)
                else:
                    key = (st.st_dev, st.st_ino)
                    if key not in seen:
                        seen[key] = tree.new("f")
                        tree.content[seen[key]] = bytearray(Path(entry.path).read_bytes())
                    child = seen[key]
                tree.entries[ino][entry.name] = child

        walk(root, 0)
        return tree

    def files(self, top: int = 0, prefix: str = "") -> Iterable[tuple[str, int]]:
        """(relative path, inode) of every entry reachable from `top`, depth first."""
        for name, ino in sorted(self.entries[top].items()):
            path = f"{prefix}{name}"
            yield path, ino
            if ino in self.entries:
                yield from self.files(ino, path + "/")


class _Parser:
    """Turns the calls of a trace into `Effect`s under `root`, keeping a model of the tree."""

    def __init__(self, root: str, tree: Tree, workloads: Iterable[str]) -> None:
        self.root = root
        self.tree = tree
        self.workloads = set(workloads)
        self.fds: dict[int, _Fd] = {}
        self.effects: list[Effect] = []
        self.stdout = b""
        self.calls: dict[int, LanceCall] = {}
        self.current_op: dict[str, str] = {}
        self.names: dict[int, set[tuple[int, str]]] = defaultdict(set)  # inode -> its entries
        self.last_path: dict[int, str] = {}  # inode -> its last name (for files without one now)
        for d, children in tree.entries.items():
            for name, ino in children.items():
                self.names[ino].add((d, name))

    # -- paths ------------------------------------------------------------------------------

    def rel(self, path: str) -> str | None:
        """`path` relative to the root, or None outside it."""
        path = os.path.normpath(path)
        if path == self.root:
            return ""
        if path.startswith(self.root + "/"):
            return path[len(self.root) + 1 :]
        return None

    def resolve(self, dirfd_token: str | None, raw: bytes) -> str:
        path = raw.decode(errors="surrogateescape")
        if path.startswith("/"):
            return os.path.normpath(path)
        if dirfd_token is None:
            base = self.root  # plain open/rename/...: the traced command runs in the root
        else:
            _, base, _ = fd_arg(dirfd_token)  # type: ignore[assignment]
            if base is None:
                raise RecorderError(f"no path decoded for directory descriptor {dirfd_token}")
        return os.path.normpath(os.path.join(base, path))

    def parent_of(self, rel: str) -> tuple[int, str]:
        head, _, name = rel.rpartition("/")
        d = self.tree.lookup(head)
        if d is None or d not in self.tree.entries:
            raise RecorderError(f"the directory of {rel} is not in the model")
        return d, name

    def workload_of(self, rel: str) -> str | None:
        top = rel.split("/", 1)[0]
        return top if top in self.workloads else None

    def path_of(self, ino: int) -> str:
        """A current name of `ino` (relative), for reports."""
        for d, name in sorted(self.names.get(ino, ())):
            if d == 0:
                return name
            return f"{self.path_of(d)}/{name}"
        return self.last_path.get(ino, f"<unnamed inode {ino}>")

    # -- effects ------------------------------------------------------------------------------

    def emit(self, call: Call, kind: str, rel: str, **kw: Any) -> Effect:
        workload = self.workload_of(rel)
        e = Effect(
            len(self.effects),
            call.start,
            call.end,
            kind,
            workload,
            call.tid,
            path=rel,
            syscall=call.name,
            op=self.current_op.get(workload or "", ""),
            **kw,
        )
        self.effects.append(e)
        return e

    def add_entry(self, d: int, name: str, ino: int) -> None:
        old = self.tree.entries[d].get(name)
        if old is not None:
            self.names[old].discard((d, name))
        self.tree.entries[d][name] = ino
        self.names[ino].add((d, name))

    def drop_entry(self, d: int, name: str) -> int:
        path = f"{self.path_of(d)}/{name}" if d else name
        ino = self.tree.entries[d].pop(name)
        self.names[ino].discard((d, name))
        if not self.names[ino]:
            self.last_path[ino] = path
        return ino

    def write_data(self, call: Call, ino: int, offset: int, data: bytes) -> None:
        content = self.tree.content[ino]
        if offset > len(content):
            content.extend(bytes(offset - len(content)))
        content[offset : offset + len(data)] = data
        self.emit(call, "write", self.path_of(ino), ino=ino, offset=offset, data=bytes(data))

    def truncate(self, call: Call, ino: int, size: int) -> None:
        content = self.tree.content[ino]
        if size < len(content):
            del content[size:]
        else:
            content.extend(bytes(size - len(content)))
        self.emit(call, "truncate", self.path_of(ino), ino=ino, offset=size)

    def fd(self, token: str) -> tuple[int, _Fd | None, str | None]:
        fd, path, _ = fd_arg(token)
        assert fd is not None
        state = self.fds.get(fd)
        if state is None and path is not None and self.rel(path) is not None:
            raise RecorderError(f"descriptor {fd} ({path}) was opened before the trace started")
        return fd, state, path

    # -- the calls -------------------------------------------------------------------------------

    def feed(self, call: Call) -> None:
        handler = getattr(self, f"_{call.name}", None)
        if handler is None:
            return
        value, _ = ret_value(call.ret)
        if value < 0 and call.name not in ("write",):
            return  # failed: no effect
        handler(call, value)

    def _open_common(self, call: Call, dirfd: str | None, path: bytes, flags: str, value: int) -> None:
        full = self.resolve(dirfd, path)
        rel = self.rel(full)
        flagset = set(flags.split("|"))
        if rel is None:
            self.fds[value] = _Fd(None)
            return
        if "O_TMPFILE" in flagset:
            d = self.tree.lookup(rel)
            if d is None:
                raise RecorderError(f"O_TMPFILE in {rel}: not in the model")
            tmp = self.tree.new("f")
            self.last_path[tmp] = f"{rel}/<O_TMPFILE {tmp}>"
            self.fds[value] = _Fd(tmp)
            return
        ino = self.tree.lookup(rel)
        if ino is None:
            if "O_CREAT" not in flagset:
                raise RecorderError(f"{call.name} opened {rel}, which the model does not have")
            d, name = self.parent_of(rel)
            ino = self.tree.new("f")
            self.add_entry(d, name, ino)
            self.emit(call, "create", rel, ino=ino, dir=d, name=name)
        elif "O_TRUNC" in flagset and ino in self.tree.content and self.tree.content[ino]:
            self.truncate(call, ino, 0)
        self.fds[value] = _Fd(ino, append="O_APPEND" in flagset)

    def _openat(self, call: Call, value: int) -> None:
        self._open_common(call, call.args[0], str_arg(call.args[1]), call.args[2], value)

    def _open(self, call: Call, value: int) -> None:
        self._open_common(call, None, str_arg(call.args[0]), call.args[1], value)

    def _creat(self, call: Call, value: int) -> None:
        self._open_common(call, None, str_arg(call.args[0]), "O_CREAT|O_WRONLY|O_TRUNC", value)

    def _close(self, call: Call, value: int) -> None:
        fd, _, _ = fd_arg(call.args[0])
        self.fds.pop(fd, None)  # type: ignore[arg-type]

    def _dup(self, call: Call, value: int) -> None:
        fd, _, _ = fd_arg(call.args[0])
        if fd in self.fds:
            self.fds[value] = self.fds[fd]  # shares the file position

    _dup2 = _dup3 = _dup

    def _lseek(self, call: Call, value: int) -> None:
        _, state, _ = self.fd(call.args[0])
        if state is not None:
            state.pos = value

    def _write_common(self, call: Call, token: str, data: bytes, value: int, offset: int | None) -> None:
        fd, state, path = self.fd(token)
        if fd == 1 and (state is None or state.ino is None):
            if value > 0:
                self._stdout(call, data[:value])
            return
        if value < 0 or state is None or state.ino is None:
            return
        if offset is None:
            at = len(self.tree.content[state.ino]) if state.append else state.pos
            state.pos = at + value
        else:
            at = offset
        if value:
            self.write_data(call, state.ino, at, data[:value])

    def _write(self, call: Call, value: int) -> None:
        self._write_common(call, call.args[0], str_arg(call.args[1]), value, None)

    def _pwrite64(self, call: Call, value: int) -> None:
        self._write_common(call, call.args[0], str_arg(call.args[1]), value, int(call.args[3]))

    def _writev(self, call: Call, value: int) -> None:
        data = b"".join(unhex(m) for m in _IOV.findall(call.args[1]))
        self._write_common(call, call.args[0], data, value, None)

    def _pwritev(self, call: Call, value: int) -> None:
        data = b"".join(unhex(m) for m in _IOV.findall(call.args[1]))
        self._write_common(call, call.args[0], data, value, int(call.args[3]))

    _pwritev2 = _pwritev

    def _ftruncate(self, call: Call, value: int) -> None:
        _, state, _ = self.fd(call.args[0])
        if state is not None and state.ino is not None:
            self.truncate(call, state.ino, int(call.args[1]))

    def _truncate(self, call: Call, value: int) -> None:
        rel = self.rel(self.resolve(None, str_arg(call.args[0])))
        if rel is not None:
            ino = self.tree.lookup(rel)
            if ino is None:
                raise RecorderError(f"truncate of {rel}: not in the model")
            self.truncate(call, ino, int(call.args[1]))

    def _fallocate(self, call: Call, value: int) -> None:
        _, state, _ = self.fd(call.args[0])
        if state is None or state.ino is None:
            return
        if call.args[1] != "0":
            raise RecorderError(f"fallocate mode {call.args[1]} is not modelled")
        end = int(call.args[2]) + int(call.args[3])
        if end > len(self.tree.content[state.ino]):
            self.truncate(call, state.ino, end)

    def _fsync(self, call: Call, value: int) -> None:
        _, state, _ = self.fd(call.args[0])
        if state is None or state.ino is None:
            return
        kind = "fsync_dir" if state.ino in self.tree.entries else "fsync"
        self.emit(call, kind, self.path_of(state.ino) if state.ino else "", ino=state.ino)

    _fdatasync = _fsync

    def _sync(self, call: Call, value: int) -> None:
        self.emit(call, "sync", "")

    def _syncfs(self, call: Call, value: int) -> None:
        self.emit(call, "sync", "")

    def _rename_common(self, call: Call, old: str, new: str, flags: str = "0") -> None:
        src, dst = self.rel(old), self.rel(new)
        if src is None and dst is None:
            return
        if src is None or dst is None or "RENAME_EXCHANGE" in flags:
            raise RecorderError(f"rename {old} -> {new} ({flags}) is not modelled")
        sd, sn = self.parent_of(src)
        dd, dn = self.parent_of(dst)
        ino = self.drop_entry(sd, sn)
        self.add_entry(dd, dn, ino)
        self.emit(call, "rename", src, ino=ino, dir=sd, name=sn, dir2=dd, name2=dn, path2=dst)

    def _rename(self, call: Call, value: int) -> None:
        self._rename_common(
            call, self.resolve(None, str_arg(call.args[0])), self.resolve(None, str_arg(call.args[1]))
        )

    def _renameat(self, call: Call, value: int) -> None:
        a = call.args
        flags = a[4] if len(a) > 4 else "0"
        self._rename_common(call, self.resolve(a[0], str_arg(a[1])), self.resolve(a[2], str_arg(a[3])), flags)

    _renameat2 = _renameat

    def _link_common(self, call: Call, source: int | None, source_path: str, new: str) -> None:
        dst = self.rel(new)
        if dst is None:
            return
        if source is None:
            raise RecorderError(f"link {source_path} -> {new}: the source is not in the model")
        d, name = self.parent_of(dst)
        self.add_entry(d, name, source)
        self.emit(call, "link", dst, ino=source, dir=d, name=name, path2=dst)

    def _link(self, call: Call, value: int) -> None:
        old = self.resolve(None, str_arg(call.args[0]))
        rel = self.rel(old)
        self._link_common(
            call,
            None if rel is None else self.tree.lookup(rel),
            old,
            self.resolve(None, str_arg(call.args[1])),
        )

    def _linkat(self, call: Call, value: int) -> None:
        a = call.args
        raw = str_arg(a[1]).decode(errors="surrogateescape")
        proc = re.fullmatch(r"/proc/(?:self|\d+)/fd/(\d+)", raw)
        if proc:
            state = self.fds.get(int(proc.group(1)))
            source = state.ino if state else None
        elif raw == "" and "AT_EMPTY_PATH" in a[4]:
            _, state, _ = self.fd(a[0])
            source = state.ino if state else None
        else:
            rel = self.rel(self.resolve(a[0], raw.encode(errors="surrogateescape")))
            source = None if rel is None else self.tree.lookup(rel)
        self._link_common(call, source, raw, self.resolve(a[2], str_arg(a[3])))

    def _remove(self, call: Call, full: str, kind: str) -> None:
        rel = self.rel(full)
        if rel is None:
            return
        d, name = self.parent_of(rel)
        ino = self.drop_entry(d, name)
        self.emit(call, kind, rel, ino=ino, dir=d, name=name)

    def _unlink(self, call: Call, value: int) -> None:
        self._remove(call, self.resolve(None, str_arg(call.args[0])), "unlink")

    def _unlinkat(self, call: Call, value: int) -> None:
        kind = "rmdir" if "AT_REMOVEDIR" in call.args[2] else "unlink"
        self._remove(call, self.resolve(call.args[0], str_arg(call.args[1])), kind)

    def _rmdir(self, call: Call, value: int) -> None:
        self._remove(call, self.resolve(None, str_arg(call.args[0])), "rmdir")

    def _mkdir_common(self, call: Call, full: str) -> None:
        rel = self.rel(full)
        if rel is None:
            return
        d, name = self.parent_of(rel)
        ino = self.tree.new("d")
        self.add_entry(d, name, ino)
        self.emit(call, "mkdir", rel, ino=ino, dir=d, name=name)

    def _mkdir(self, call: Call, value: int) -> None:
        self._mkdir_common(call, self.resolve(None, str_arg(call.args[0])))

    def _mkdirat(self, call: Call, value: int) -> None:
        self._mkdir_common(call, self.resolve(call.args[0], str_arg(call.args[1])))

    def _copy_file_range(self, call: Call, value: int) -> None:
        _, state, _ = self.fd(call.args[2])
        if state is not None and state.ino is not None:
            raise RecorderError(f"{call.name} into the table directory is not modelled")

    def _sendfile(self, call: Call, value: int) -> None:
        _, state, _ = self.fd(call.args[0])
        if state is not None and state.ino is not None:
            raise RecorderError(f"{call.name} into the table directory is not modelled")

    # -- stdout -----------------------------------------------------------------------------------

    def _stdout(self, call: Call, data: bytes) -> None:
        self.stdout += data
        while b"\n" in self.stdout:
            line, self.stdout = self.stdout.split(b"\n", 1)
            self._line(call, line.decode())

    def _line(self, call: Call, line: str) -> None:
        who, kind, *rest = line.split(" ", 2)
        payload = rest[0] if rest else ""
        if who == "-":
            if kind == "BEGIN":
                number, name, caller = payload.split(" ", 2)
                op = ",".join(f"{w}:{o}" for w, o in sorted(self.current_op.items()) if o)
                self.calls[int(number)] = LanceCall(int(number), name, caller, call.end, op=op)
            elif kind == "END":
                self.calls[int(payload)].end = call.start
            return
        if kind == "OP":
            self.current_op[who] = payload
        elif kind == "INTENT":
            op = json.loads(payload)
            self.current_op[who] = f"{op['op']} #{op['n']}"
        e = self.emit(call, "out", who if who in self.workloads else "", text=f"{kind} {payload}".rstrip())
        e.workload = who
        if kind in ("DONE", "ACK"):
            self.current_op[who] = ""


def _mark_durability(effects: list[Effect]) -> None:
    """`durable_at` of every data and directory effect: the index of the first fsync (of the file,
    of the directory; of both directories for a rename) or sync whose entry comes after the effect
    completed."""
    file_syncs: dict[int, list[Effect]] = defaultdict(list)
    dir_syncs: dict[int, list[Effect]] = defaultdict(list)
    global_syncs: list[Effect] = []
    for e in effects:
        if e.kind == "fsync":
            file_syncs[e.ino].append(e)  # type: ignore[index]
        elif e.kind == "fsync_dir":
            dir_syncs[e.ino].append(e)  # type: ignore[index]
        elif e.kind == "sync":
            global_syncs.append(e)

    def first_after(syncs: list[Effect], done: int) -> float:
        found = [s.index for s in syncs if s.start > done]
        return min(found) if found else float("inf")

    for e in effects:
        if e.kind in DATA_OPS:
            e.durable_at = min(first_after(file_syncs[e.ino], e.end), first_after(global_syncs, e.end))  # type: ignore[index]
        elif e.kind in DIR_OPS:
            e.durable_in = {
                d: min(first_after(dir_syncs[d], e.end), first_after(global_syncs, e.end)) for d in e.dirs()
            }
            e.durable_at = max(e.durable_in.values())


def parse_trace(
    trace: Path, root: Path, workloads: Iterable[str], base: Tree
) -> tuple[list[Effect], list[LanceCall], Tree]:
    tree = Tree()
    tree.entries = {d: dict(c) for d, c in base.entries.items()}
    tree.content = {i: bytearray(c) for i, c in base.content.items()}
    tree.next = base.next
    parser = _Parser(str(root), tree, workloads)
    for call in read_calls(trace):
        try:
            parser.feed(call)
        except RecorderError as e:
            raise RecorderError(f"trace line {call.end} ({call.name}): {e}") from None
        except (ValueError, IndexError, KeyError) as e:
            raise RecorderError(
                f"trace line {call.end}: cannot model {call.name}{tuple(call.args)!r:.300}: {e!r}"
            ) from e
    _mark_durability(parser.effects)
    return parser.effects, sorted(parser.calls.values(), key=lambda c: c.begin), tree
