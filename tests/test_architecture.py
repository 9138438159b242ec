"""The package's structure, read from the source with `ast`: every import of every module of
`memwal_df` (at the top, inside functions and under `if TYPE_CHECKING:` alike) is an edge between two
modules, and the tests check

* no import cycle between modules;
* the layers, lowest first: `errors` / `pools` / `_lance_log` < `format` < `write` < `read`
  < `jobs` < `table` < `cli` / `spark` < `memwal_df` (`__init__`) / `__main__`: a module imports
  only from its own layer or lower ones;
* no module imports another module's private name (`_name`: a function, class or module; a package
  may import its own private submodules);
* no module is over 600 lines (the generated protobuf code aside).

Importing `a.b.c` also runs the `__init__` of `a` and `a.b`; those implicit imports are not edges.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "memwal_df"
GENERATED = {"memwal_df/format/proto/memwal_pb2.py", "memwal_df/server/proto/FlightSql_pb2.py"}
MAX_LINES = 600

LAYERS: list[tuple[str, ...]] = [
    ("errors", "pools", "_lance_log"),
    ("format",),
    ("write",),
    ("read",),
    ("jobs",),
    ("table",),
    ("cli", "spark", "server"),
    ("", "__main__"),  # the package's __init__ (its name has no part after `memwal_df`)
]


@dataclass(frozen=True)
class Import:
    """One import in a module: `source` imports `target` (a module), naming `name` in it (None when
    the whole module is imported)."""

    source: str
    target: str
    name: str | None
    path: str  # the source file, relative to the repository root
    line: int

    def __str__(self) -> str:
        what = self.target if self.name is None else f"{self.name} from {self.target}"
        return f"{self.path}:{self.line} imports {what}"


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every `.py` file of the package."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, relative imports resolved against `module`."""
    if node.level == 0:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str) -> Iterator[Import]:
    """Every import of another `memwal_df` module in `module`, wherever it stands in the file."""
    path = MODULES[module]
    rel = str(path.relative_to(ROOT))
    for node in ast.walk(ast.parse(path.read_text(), rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield Import(module, alias.name, None, rel, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node)
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:
                    yield Import(module, submodule, None, rel, node.lineno)
                else:
                    yield Import(module, target, alias.name, rel, node.lineno)


def all_imports() -> list[Import]:
    return [i for module in MODULES for i in imports_of(module) if i.target != module]


def layer(module: str) -> int:
    """The rank of `module`'s layer in `LAYERS` (0 lowest)."""
    first = module.split(".")[1] if "." in module else ""
    for rank, names in enumerate(LAYERS):
        if first in names:
            return rank
    raise AssertionError(f"{module} belongs to no layer: add its top-level name to LAYERS")


def _layer_name(module: str) -> str:
    return " / ".join(n or "__init__" for n in LAYERS[layer(module)])


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer(module)


def test_no_import_cycles() -> None:
    edges: dict[str, dict[str, Import]] = {m: {} for m in MODULES}
    for imp in all_imports():
        if imp.target in MODULES:
            edges[imp.source].setdefault(imp.target, imp)
    cycles = [_cycle(component, edges) for component in _strongly_connected(edges) if len(component) > 1]
    described = [
        " -> ".join(cycle) + "".join(f"\n    {edges[a][b]}" for a, b in _pairs(cycle)) for cycle in cycles
    ]
    if described:
        pytest.fail("import cycles:\n" + "\n".join(described))


def test_modules_import_only_their_own_layer_or_lower_ones() -> None:
    upward = [
        f"{imp} ({_layer_name(imp.source)} may not import {_layer_name(imp.target)})"
        for imp in all_imports()
        if imp.target in MODULES and layer(imp.target) > layer(imp.source)
    ]
    if upward:
        pytest.fail("imports from a higher layer:\n" + "\n".join(upward))


# The read path's own floors, lowest first: a kind of query imports the core and the floors below it,
# never a sibling kind or the way in.
READ_LAYERS: list[tuple[str, ...]] = [
    ("exec", "expr"),
    ("lsm",),
    ("scan", "lookup", "changes"),
    ("search",),
    ("dataset",),
    ("sql", ""),  # `read/__init__.py` names the way in
]


def read_layer(module: str) -> int:
    """The rank of a `memwal_df.read` module's floor in `READ_LAYERS` (0 lowest)."""
    parts = module.split(".")
    first = parts[2] if len(parts) > 2 else ""
    for rank, names in enumerate(READ_LAYERS):
        if first in names:
            return rank
    raise AssertionError(f"{module} belongs to no floor of the read path: add it to READ_LAYERS")


def test_read_path_modules_import_only_lower_floors() -> None:
    """Within `read`, each kind of query (scan, lookup, search, changes) stands on the shared core
    (`lsm`, `expr`, `exec`) and imports no sibling kind on its floor or anything above it."""
    read = [m for m in MODULES if m.startswith(f"{PACKAGE}.read")]
    upward = []
    for module in read:
        for imp in imports_of(module):
            inside = imp.target in MODULES and imp.target.startswith(f"{PACKAGE}.read")
            if not inside or imp.target == module:
                continue
            src, dst = read_layer(module), read_layer(imp.target)
            sibling = src == dst and module.split(".")[2:3] != imp.target.split(".")[2:3]
            if dst > src or sibling:
                upward.append(str(imp))
    if upward:
        pytest.fail("read-path imports from a higher floor or a sibling kind of query:\n" + "\n".join(upward))


def test_no_module_imports_another_modules_private_names() -> None:
    private = []
    for imp in all_imports():
        dotted = imp.target if imp.name is None else f"{imp.target}.{imp.name}"
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            owner = ".".join(parts[:i])
            if _is_private(part) and owner != imp.source:
                private.append(f"{imp} (private to {owner})")
                break
    if private:
        pytest.fail("imports of private names:\n" + "\n".join(private))


def test_no_module_is_over_the_line_limit() -> None:
    long = []
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if rel not in GENERATED and lines > MAX_LINES:
            long.append(f"{rel}: {lines} lines")
    if long:
        pytest.fail(f"modules over {MAX_LINES} lines:\n" + "\n".join(long))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _pairs(cycle: list[str]) -> list[tuple[str, str]]:
    return list(zip(cycle, cycle[1:], strict=False))


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the import graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _cycle(component: list[str], edges: dict[str, dict[str, Import]]) -> list[str]:
    """One cycle through the first module of a strongly connected component: start, ..., start."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to `start`
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w == start:
                    return [*paths[v], start]
                if w in members and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def _code_map() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## Code map")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_code_map_names_every_module() -> None:
    """docs/architecture.md's code map lists every module of the package by its path."""
    code_map = _code_map()
    missing = [
        str(path.relative_to(ROOT))
        for path in MODULES.values()
        if path.name != "__init__.py"
        and str(path.relative_to(ROOT)) not in GENERATED
        and f"`{path.relative_to(ROOT / PACKAGE)}`" not in code_map
    ]
    assert not missing, "modules missing from the code map of docs/architecture.md:\n" + "\n".join(missing)


def test_docs_name_only_files_that_exist() -> None:
    """Every `memwal_df/...py` path in the docs, the README and the code map is a file of the tree."""
    import re

    texts = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    folders = "format|write|read|jobs|cli|spark|server"
    texts[ROOT / "docs" / "architecture.md (code map)"] = re.sub(
        rf"`((?:{folders})/[\w/]+\.py|[\w]+\.py)`", r"`memwal_df/\1`", _code_map()
    )
    stale = [
        f"{doc.relative_to(ROOT)}: {path}"
        for doc, text in texts.items()
        for path in sorted(set(re.findall(r"memwal_df/[\w/]+\.pyi?", text)))
        if not (ROOT / path).exists()
    ]
    assert not stale, "paths in the docs that are not in the tree:\n" + "\n".join(stale)


def test_the_code_map_table_is_what_the_script_prints() -> None:
    """The code map's table is `scripts/code_map.py`'s output: each module's docstring, as it is now."""
    import subprocess
    import sys

    printed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "code_map.py")], capture_output=True, text=True, check=True
    ).stdout
    stale = "docs/architecture.md's code map is stale: paste the output of `python scripts/code_map.py`"
    assert printed.strip() in _code_map(), stale
