"""The README and the guide under docs/ stay true: the config reference is the one the code generates, CI
runs the README's commands, the README stays a short front page that links every page, and no link is broken."""

import re
from pathlib import Path

from infinity import Config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")   # the target of a markdown link or image: ](target)


def relative_links(page):
    """The targets of `page`'s markdown links that name a file here: no URL, no bare #anchor; anchor dropped."""
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


def test_config_reference_is_current():
    reference = (DOCS / "config.md").read_text()
    assert Config.reference_markdown() in reference, \
        "regenerate docs/config.md's config reference from Config.reference_markdown()"


def test_ci_runs_the_readme_commands():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    for command in ("pip install torch==2.13.0", 'pip install -e ".[test]"', "ruff check .", "lint-imports",
                    "python -m pytest -q -n 2 --dist loadfile"):
        assert command in readme, command
        in_ci = command.replace("python -m", "python3 -m").replace("pip install", "python3 -m pip install --quiet")
        assert in_ci in ci or command in ci, command


def test_readme_is_a_short_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: move detail into a page under docs/"
    first_screen = "\n".join(lines[:60])
    for command in ("infinity train", "python -m pytest -q -n 2 --dist loadfile"):
        assert command in first_screen, f"{command!r} must be in the README's first 60 lines"


def test_readme_links_every_docs_page():
    linked = {(ROOT / target).resolve() for target in relative_links(README)}
    pages = sorted(DOCS.glob("*.md"))
    assert {"architecture.md", "scaling.md"} <= {page.name for page in pages}
    unlinked = [page.name for page in pages if page.resolve() not in linked]
    assert not unlinked, f"README.md's Guide must link every docs page; missing: {unlinked}"


def test_relative_links_point_at_files():
    broken = [f"{page.relative_to(ROOT)} -> {target}"
              for page in [README, *sorted(DOCS.glob("*.md"))]
              for target in relative_links(page)
              if target and not (page.parent / target).exists()]
    assert not broken, f"links to files that do not exist: {broken}"
