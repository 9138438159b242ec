"""Old import paths: `memwal_df.region`, `memwal_df.exec.knn`, ... name the modules that now live in
`format`, `write`, `read` and `jobs`. Importing an old path returns the module at its new path (the
same module object) and warns with a `DeprecationWarning` naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

MOVED: dict[str, str] = {
    "_pools": "pools",
    "_wire": "format.wire",
    "_proto": "format.proto",
    "storage": "format.storage",
    "layout": "format.layout",
    "wal": "format.wal",
    "manifest": "format.manifest",
    "memwal_index": "format.memwal_index",
    "region_snapshot": "format.region_snapshot",
    "bloom": "format.bloom",
    "pk_index": "format.pk_index",
    "murmur3": "format.murmur3",
    "lease": "format.lease",
    "entry_lease": "format.entry_lease",
    "schema": "format.schema",
    "region_spec": "format.regions",
    "intexpr": "format.regions.intexpr",
    "tokenizer": "format.tokenizer",
    "stop_words": "format.stop_words",
    "maintained": "format.maintained_indexes",
    "memtable": "write.memtable",
    "memtable_index": "write.memtable_index",
    "generation": "write.generation",
    "region": "write.region_writer",
    "writer": "write.table_writer",
    "snapshot": "read.snapshot",
    "planner": "read.scan_planner",
    "predicate": "read.predicate",
    "catchup": "read.catchup",
    "search": "read.search",
    "dataset": "read.dataset",
    "sql": "read.sql",
    "sqlexpr": "read.sqlexpr",
    "exec": "read.exec",
    "exec.lookup_plan": "read.lookup_planner",
    "exec._cache": "read.cache",
    "exec._keys": "read.keys",
    "exec._levels": "read.levels",
    "exec._sq8": "read.sq8",
    "exec.keyset": "read.keys",
    "exec.generation_rows": "read.generation_rows",
    "merger": "jobs.merger",
    "index_builder": "jobs.index_builder",
    "index_catchup": "jobs.index_catchup",
    "gc": "jobs.garbage",
    "maintain": "jobs.maintain",
    "repair": "jobs.repair",
}


def new_path(fullname: str) -> str | None:
    """The module path that the old path `fullname` names now, or None if it did not move."""
    if not fullname.startswith("memwal_df."):
        return None
    parts = fullname.split(".")[1:]
    for cut in range(len(parts), 0, -1):
        moved = MOVED.get(".".join(parts[:cut]))
        if moved is not None:
            return "memwal_df." + ".".join([moved, *parts[cut:]])
    return None


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if new_path(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = new_path(spec.name)
        assert new is not None
        warnings.warn(f"{spec.name} has moved to {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: types.ModuleType) -> None:
        """The module was executed under its new path already."""


def install() -> None:
    """Make the old import paths resolve (once per process)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        # First, so that a submodule of an old package path (`memwal_df.exec.knn`) is the module at
        # its new path, not a second copy that the path finder would load from the aliased package.
        sys.meta_path.insert(0, _OldPaths())
