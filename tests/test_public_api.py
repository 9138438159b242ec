"""The public surface of `memwal_df`: every name in `__all__` exists, `__version__` is the installed
distribution's, and every class memwal_df defines that the public API takes or returns is importable
from `memwal_df` itself, or from a submodule `memwal_df.__all__` lists (`memwal_df.errors`, ...).

The walk starts at the names in `memwal_df.__all__` (and in the `__all__` of the submodules it
lists) and follows type annotations (resolved with
`typing.get_type_hints`, names imported under `if TYPE_CHECKING:` included): a function's
parameters and return type; a class's annotated attributes, and the parameters and return types of
its public methods, properties and constructor; then the classes those name, recursively. Members
that are plumbing between memwal_df's own modules rather than something a user calls are listed in
`INTERNAL` with the reason, and the walk does not follow them.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib
import importlib.metadata
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from google.protobuf.message import Message

import memwal_df

# "Class.member" (the class that defines the member): why a user never calls it, so what it takes
# and returns need not be exported.
INTERNAL: dict[str, str] = {
    "MemWalTable.get_fragments": "pyarrow's Dataset protocol, called by DataFusion while it plans a scan",
    "MemWalTable.scanner": "pyarrow's Dataset protocol, called by DataFusion on its worker threads",
    "MemWalTable.read_snapshot": "the levels a query reads, taken by the scan and search planners",
    "TableWriter.__init__": "built by Table.writer()",
    "RegionWriter.__init__": "built by Table.region_writer()",
    "RegionWriter.memtables": "the writer's MemTables, read by MemWalTable(uri, writer=w)",
    "RegionWriter.memtable_snapshot": "the writer's MemTables, read by MemWalTable(uri, writer=w)",
    "RegionWriter.apply_merged": "the Spark data source's partial merge",
    "RegionWriter.merged_write": "the Spark data source's partial merge",
    "RegionWriter.manifest": "the region manifest as stored (protobuf); Table.region_status() describes it",
    "ChangeFeed.__init__": "built by Table.changes()",
    "Server.__init__": "built by memwal_df.serve()",
    "TableHandle.region_values": "decodes a stored region manifest; Table.region_status() has the values",
    "RegionSpec.prune": "region pruning of the read planner",
    "RegionSpec.to_proto": "the spec as stored in the MemWAL index (protobuf)",
    "RegionSpec.from_proto": "the spec as stored in the MemWAL index (protobuf)",
    "RegionField.to_proto": "the field as stored in the MemWAL index (protobuf)",
    "RegionField.from_proto": "the field as stored in the MemWAL index (protobuf)",
    "Transform.project": "region pruning of the read planner",
    "Transform.project_sources": "region pruning of the read planner",
}

# Methods whose types the walk follows though their names start with an underscore.
DUNDER = ("__init__", "__call__", "__enter__", "__iter__", "__next__", "__getitem__")


def own_module(obj: Any) -> str:
    return getattr(obj, "__module__", None) or ""


def is_memwal_df_class(cls: type) -> bool:
    """Defined in memwal_df: a module of the package, or a message of memwal_df's protobuf schema
    (its generated module is named `memwal_pb2`, outside the package's namespace)."""
    if issubclass(cls, Message):
        return own_module(cls) == "memwal_pb2"
    module = own_module(cls)
    return module == "memwal_df" or module.startswith("memwal_df.")


def exported_modules() -> list[types.ModuleType]:
    """The submodules `memwal_df.__all__` lists (`memwal_df.errors`, ...): what they export is public."""
    return [m for name in memwal_df.__all__ if isinstance(m := getattr(memwal_df, name), types.ModuleType)]


def module_exports(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    return list(names) if names is not None else [n for n in vars(module) if not n.startswith("_")]


def is_exported(cls: type) -> bool:
    """Importable from `memwal_df`, or from a submodule it exports (under the same name)."""
    if getattr(memwal_df, cls.__name__, None) is cls:
        return True
    return any(
        cls.__name__ in module_exports(m) and getattr(m, cls.__name__, None) is cls
        for m in exported_modules()
    )


@functools.cache
def type_checking_names(module_name: str) -> dict[str, Any]:
    """The names a module imports under `if TYPE_CHECKING:`, imported for real, so that annotations
    naming them resolve."""
    module = sys.modules[module_name]
    tree = ast.parse(inspect.getsource(module))
    names: dict[str, Any] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.ImportFrom):
                package = module.__package__ if stmt.level else None
                source = importlib.import_module("." * stmt.level + (stmt.module or ""), package)
                for alias in stmt.names:
                    value = getattr(source, alias.name, None)
                    if value is None:  # a submodule
                        value = importlib.import_module(f"{source.__name__}.{alias.name}")
                    names[alias.asname or alias.name] = value
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    imported = importlib.import_module(alias.name)
                    if alias.asname:
                        names[alias.asname] = imported
                    else:
                        names[alias.name.split(".")[0]] = sys.modules[alias.name.split(".")[0]]
    return names


def namespace(module_name: str) -> dict[str, Any]:
    return {**vars(sys.modules[module_name]), **type_checking_names(module_name)}


def function_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    fn = inspect.unwrap(fn)
    return typing.get_type_hints(fn, globalns=namespace(fn.__module__))


def attribute_hints(cls: type) -> dict[str, Any]:
    """The annotated attributes of `cls` and of its memwal_df base classes, each resolved in the
    namespace of the module that defines it."""
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        own = vars(klass).get("__annotations__")
        if not own or not is_memwal_df_class(klass) or issubclass(klass, Message):
            continue
        holder = type(klass.__name__, (), {"__annotations__": dict(own)})  # klass's own, no bases
        globalns, localns = namespace(klass.__module__), dict(vars(klass))
        hints.update(typing.get_type_hints(holder, globalns=globalns, localns=localns))
    return hints


def classes_in(tp: Any) -> Iterator[type]:
    """Every class a type expression names (unions, generics, callables, aliases, type variables)."""
    if isinstance(tp, typing.TypeVar):
        if tp.__bound__ is not None:
            yield from classes_in(tp.__bound__)
        for constraint in tp.__constraints__:
            yield from classes_in(constraint)
        return
    if isinstance(tp, typing.NewType):
        yield from classes_in(tp.__supertype__)
        return
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return
    if origin is not None:
        if isinstance(origin, type):
            yield origin
        for arg in typing.get_args(tp):
            for a in arg if isinstance(arg, list) else [arg]:  # Callable[[A, B], R]
                yield from classes_in(a)
        return
    if isinstance(tp, type):
        yield tp


def public_members(cls: type) -> Iterator[tuple[str, Callable[..., Any]]]:
    """("DefiningClass.name", function) of the public methods, properties and constructor of `cls`,
    with those it inherits from memwal_df base classes (not those of pyarrow's Dataset or `object`)."""
    for name in dir(cls):
        if name.startswith("_") and name not in DUNDER:
            continue
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or not is_memwal_df_class(owner) or issubclass(owner, Message):
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, staticmethod | classmethod):
            attr = attr.__func__
        elif isinstance(attr, property):
            attr = attr.fget
        elif isinstance(attr, functools.cached_property):
            attr = attr.func
        if inspect.isfunction(attr):
            yield f"{owner.__name__}.{name}", attr


def walk(roots: Iterable[str] | None = None) -> dict[type, str]:
    """Every memwal_df class reachable from `roots` (names in memwal_df; default: `__all__`) -> how
    the walk first reached it."""
    reached: dict[type, str] = {}
    queue: list[type] = []

    def reach(tp: Any, via: str) -> None:
        for cls in classes_in(tp):
            if is_memwal_df_class(cls) and cls not in reached:
                reached[cls] = via
                queue.append(cls)

    entry_points = [(memwal_df, name) for name in (memwal_df.__all__ if roots is None else roots)]
    if roots is None:
        entry_points += [(m, name) for m in exported_modules() for name in module_exports(m)]
    for module, name in entry_points:
        obj = getattr(module, name)
        if isinstance(obj, type):
            reach(obj, f"{module.__name__}.{name}")
        elif inspect.isfunction(obj):
            for tp in function_hints(obj).values():
                reach(tp, f"{module.__name__}.{name}()")
    while queue:
        cls = queue.pop()
        if issubclass(cls, Message | enum.Enum):
            continue
        for attr, tp in attribute_hints(cls).items():
            reach(tp, f"{cls.__name__}.{attr}")
        for member, fn in public_members(cls):
            if member in INTERNAL:
                continue
            for tp in function_hints(fn).values():
                reach(tp, f"{member}()")
    return reached


def test_every_name_in_all_exists():
    missing = [name for name in memwal_df.__all__ if not hasattr(memwal_df, name)]
    assert not missing, f"memwal_df.__all__ names what memwal_df does not define: {missing}"
    assert len(set(memwal_df.__all__)) == len(memwal_df.__all__), "a name is listed twice in __all__"


def test_version_is_the_installed_distribution_version():
    assert memwal_df.__version__ == importlib.metadata.version("memwal_df")


def test_every_class_the_public_api_takes_or_returns_is_exported():
    reached = walk()
    unexported = sorted(
        f"{cls.__module__}.{cls.__qualname__} (reached from {via})"
        for cls, via in reached.items()
        if not is_exported(cls)
    )
    assert not unexported, "import these from memwal_df (and list them in __all__):\n" + "\n".join(unexported)


def test_exported_classes_are_listed_in_all():
    listed = set(memwal_df.__all__)
    top_level = [cls for cls in walk() if getattr(memwal_df, cls.__name__, None) is cls]
    unlisted = sorted(cls.__name__ for cls in top_level if cls.__name__ not in listed)
    assert not unlisted, f"memwal_df defines but __all__ leaves out: {unlisted}"


REACHED_FROM_ENTRY_POINTS = (
    "Consumer ChangeFeed ChangeOffsets MergeResult RegionMerge GcResult BuildResult CatchUpResult Round "
    "RegionSpec RegionField UnboundRegionSpec MaintainedIndex CompactionSettings RepairPlan Applied "
    "RegionWriter TableWriter"
).split()


@pytest.mark.parametrize("name", REACHED_FROM_ENTRY_POINTS)
def test_the_walk_reaches_result_types_from_the_entry_points(name):
    """From the entry points alone, the walk finds what their methods take and return."""
    assert name in reached_from_entry_points()


@functools.cache
def reached_from_entry_points() -> set[str]:
    return {cls.__name__ for cls in walk(["create_table", "open_table", "bucket", "MemWalTable"])}


def test_internal_members_exist():
    """Every entry of INTERNAL names a member of a class the walk reaches: a renamed or removed
    member cannot leave an exemption behind."""
    members = {member for cls in walk() for member, _ in public_members(cls)}
    stale = sorted(set(INTERNAL) - members)
    assert not stale, f"INTERNAL names members that no longer exist: {stale}"


def test_the_walk_reports_an_unexported_class(monkeypatch):
    """The check fails when a class the API returns is not importable from memwal_df."""
    monkeypatch.setattr(memwal_df, "__all__", [n for n in memwal_df.__all__ if n != "Applied"])
    monkeypatch.delattr(memwal_df, "Applied")
    reached = walk()
    assert any(cls.__name__ == "Applied" and not is_exported(cls) for cls in reached)
