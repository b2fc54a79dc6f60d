"""docs/architecture.md stays true: it names every module file and indexes every design Note.

The document is the project's own account of its layers (DESIGN.md leaves internals to it), so a
module or a `Note [...]` the code gains without the document is a defect this test reports by name.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
NOTE = re.compile(r"Note \[([^\]]+)\]")


def _sources() -> list[Path]:
    return sorted(p for pkg in ("infinity", "io_engine") for p in (ROOT / pkg).rglob("*.py"))


def test_every_module_file_is_named():
    missing = [str(p.relative_to(ROOT)) for p in _sources()
               if p.name != "__init__.py" and p.relative_to(ROOT).as_posix() not in DOC
               and f"`{p.stem}`" not in DOC and f"{p.parent.name}/{p.name}" not in DOC]
    assert not missing, f"docs/architecture.md does not name these module files: {missing}"


def test_every_note_is_indexed():
    index = DOC[DOC.index("## 4."):]
    notes = {" ".join(name.split()) for p in _sources() for name in NOTE.findall(p.read_text())}
    missing = sorted(n for n in notes if f"[{n}]" not in index)
    assert not missing, f"docs/architecture.md's Note index lacks: {missing}"


def test_no_module_imports_another_modules_private_names():
    """Layer rule 5 (docs/architecture.md): a name with a leading underscore is its module's own."""
    import ast
    offenders = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
                continue
            ours = node.level > 0 or (node.module or "").split(".")[0] in ("infinity", "io_engine")
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if ours and private:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module} {private}")
    assert not offenders, f"imports of another module's private names: {offenders}"
