"""Every ```toml block in README.md and docs/*.md is valid TOML that the job loader accepts (a job file or the
engine sections of one), so an example copied into a file runs (a block that put several keys on one line did
not: "invalid TOML: Expected newline")."""

import re
import tomllib
from pathlib import Path

import pytest

from infinity.job.spec import load_job

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```toml\n(.*?)^```", re.MULTILINE | re.DOTALL)


def toml_blocks():
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            yield pytest.param(match.group(1), id=f"{page.relative_to(ROOT)}:{line}")


def test_the_pages_have_toml_examples():
    assert len(list(toml_blocks())) >= 4  # (the pattern finds them: job.md, bytes.md, loop.md, tiers.md)


@pytest.mark.parametrize("block", toml_blocks())
def test_a_toml_example_parses_and_loads_as_a_job_file(block, tmp_path):
    tomllib.loads(block)  # a TOMLDecodeError names the line and column
    path = tmp_path / "job.toml"
    path.write_text(block)
    load_job(path)
