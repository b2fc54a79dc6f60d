"""Every file path the repository's documents, docstrings and comments cite exists in the repository: a move of
modules (the job/ split of 2026-11-28 moved eleven) must carry its citations along, and nothing may point outside
the repository (a reader has only the repository)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w./${-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|sh|toml|json|txt|gz))\b")
OUTPUTS = ("runs/",)  # a run directory the user's command makes, not a file of the repository


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if (ROOT / f).exists()]


def _unresolved(files: list[str], tracked: set[str]) -> dict[str, set[str]]:
    bad: dict[str, set[str]] = {}
    for f in files:
        for path in PATH.findall((ROOT / f).read_text()):
            if path.startswith(OUTPUTS):
                continue
            here = (Path(f).parent / path).as_posix()
            if not any(c in tracked for c in (path, here, f"infinity/{path}", f"tests/{path}", f"benchmarks/{path}")):
                bad.setdefault(path, set()).add(f)
    return bad


def test_every_cited_path_exists():
    tracked = _tracked()
    sources = [f for f in tracked if f.endswith((".py", ".md", ".sh", ".toml"))
               and not f.startswith(("benchmarks/history/", "benchmarks/results/"))]
    bad = _unresolved(sources, set(tracked))
    assert not bad, "paths cited but not in the repository: " + "; ".join(
        f"{p} (in {', '.join(sorted(where))})" for p, where in sorted(bad.items()))

