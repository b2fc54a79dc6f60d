"""The configuration: `Config` and one dataclass per TOML section (sections.py), and the option machinery
every section is declared with (options.py). Imports no torch (a lint-imports contract)."""
