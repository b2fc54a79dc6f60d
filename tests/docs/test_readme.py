"""The README stays true: its config reference is the one the code generates, and CI runs its commands."""

from pathlib import Path

from infinity.config.sections import Config

ROOT = Path(__file__).resolve().parents[2]


def test_readme_config_reference_is_current():
    readme = (ROOT / "README.md").read_text()
    assert Config.reference_markdown() in readme, \
        "regenerate the README's config reference from Config.reference_markdown()"


def test_ci_runs_the_readme_commands():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    for command in ("pip install torch==2.13.0", 'pip install -e ".[test]"', "ruff check .", "lint-imports",
                    "python -m pytest -q"):
        assert command in readme, command
        in_ci = command.replace("python -m", "python3 -m").replace("pip install", "python3 -m pip install --quiet")
        assert in_ci in ci or command in ci, command
