"""docs/architecture.md stays true: it names every module file and indexes every design Note.

The document is the project's own account of its layers (the public API's contract leaves internals to it), so a
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


def _defined_in() -> dict[str, set[str]]:
    """Each Note's name -> the files that define it (`Note [name]:`, not a parenthesized reference)."""
    out: dict[str, set[str]] = {}
    for p in _sources():
        text = " ".join(p.read_text().replace("#", " ").split())
        for name in re.findall(r"(?<!\()Note \[([^\]]+)\]:", text):
            out.setdefault(name, set()).add(p.relative_to(ROOT).as_posix())
    return out


def test_each_note_is_indexed_where_it_is_defined():
    index = DOC[DOC.index("## 4."):]
    rows = re.findall(r"^\| \[([^\]]+)\] \|.*?\| `([^`]+)` \|", index, re.M)
    defined = _defined_in()
    wrong = [f"[{name}] indexed in {file}, defined in {sorted(defined.get(name, ())) or 'no file'}"
             for name, file in rows if file not in defined.get(name, ())]
    assert not wrong, wrong


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


def _diagram_lines() -> dict[str, str]:
    """Section 1's layer diagram: each package's text (its line and the lines under it), keyed by every package
    the line names (`plan/ | data/` names two)."""
    block = DOC[DOC.index("## 1. Layers"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    out: dict[str, str] = {}
    current: list[str] = []
    for line in block.splitlines():
        head = re.match(r"^ {1,3}((?:[a-z_]+/(?: \| )?)+)", line)
        if head:
            current = re.findall(r"([a-z_]+)/", head.group(1))
            for name in current:
                out[name] = ""
        for name in current:
            out[name] += " " + line
    return out


def test_the_layer_diagram_names_every_module_on_its_packages_line():
    lines = _diagram_lines()
    missing = []
    for pkg_root in ("infinity", "io_engine"):
        for p in sorted((ROOT / pkg_root).rglob("*.py")):
            if p.name in ("__init__.py", "__main__.py"):
                continue
            rel = p.relative_to(ROOT / pkg_root)
            package = pkg_root if len(rel.parts) == 1 or pkg_root == "io_engine" else rel.parts[0]
            text = lines.get(package, "")
            if not re.search(rf"(?<![\w]){re.escape(p.stem)}(?![\w])", text):
                missing.append(f"{p.relative_to(ROOT)} (line of {package}/)")
    assert not missing, f"the layer diagram of docs/architecture.md does not name: {missing}"
