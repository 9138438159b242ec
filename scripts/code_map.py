"""Print the code map table of docs/architecture.md: one row per module of `memwal_df`, with the first
sentence of its docstring. Run `python scripts/code_map.py` and paste its output over the table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = re.compile(r"_pb2\.pyi?$")


def first_sentence(doc: str) -> str:
    """The docstring's first sentence (up to a period that ends a sentence), on one line."""
    text = " ".join(doc.split("\n\n", 1)[0].split())
    for match in re.finditer(r"\.(\s|$)", text):
        if not re.search(r"\b(e\.g|i\.e|etc|vs)$", text[: match.start()]):
            return text[: match.start()].replace("|", "\\|")
    return text.replace("|", "\\|")


def rows() -> list[str]:
    package = ROOT / "memwal_df"
    out = []
    for path in sorted(package.rglob("*.py"), key=lambda p: (len(p.relative_to(package).parts) > 1, str(p))):
        rel = path.relative_to(package)
        if path.name == "__init__.py" or GENERATED.search(path.name):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        folder = "/".join(rel.parts[:-1]).split("/")[0] if len(rel.parts) > 1 else ""
        out.append(f"| {folder} | `{rel}` | {first_sentence(doc)} |")
    return out


if __name__ == "__main__":
    print("| package | module | what it owns |")
    print("|---|---|---|")
    print("\n".join(rows()))
