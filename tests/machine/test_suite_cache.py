"""The test suite never reads or writes the user's cache of link rates and runtime probes (tests/conftest.py): in
the suite, and in a process a test starts, the cache is the suite's own directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from infinity.machine.link_rates import cache_path


def test_the_cache_in_the_suite_and_its_processes_is_the_suites():
    suite = Path(os.environ["INFINITY_SUITE_CACHE"])
    assert cache_path().parent == suite
    child = subprocess.run([sys.executable, "-c", "from infinity.machine.link_rates import cache_path; "
                            "print(cache_path())"], capture_output=True, text=True, check=True)
    assert Path(child.stdout.strip()).parent == suite
    assert not str(cache_path()).startswith(str(Path.home() / ".cache"))
