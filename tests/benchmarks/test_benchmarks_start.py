"""Every benchmark script still starts after a move of modules: its `--help` runs (the module and its top-level
imports load, its arguments parse), and every name it takes from infinity or io_engine, at any depth (imports
inside functions, and attributes of an imported module: `ckpt.read_manifest`), exists where it takes it from.
Benchmarks are not in the suite's timed runs, so a moved function broke `bench_soak.py --faults` unnoticed
(`infinity.state.checkpoint.read_manifest`, moved to checkpoint_load)."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "__main__" in p.read_text())
OURS = ("infinity", "io_engine")


def _missing_names(path: Path) -> list[str]:
    """Names `path` imports from our packages (or reads off a module of them it imported) that do not exist."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}  # local name -> our module
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in OURS:
                    importlib.import_module(a.name)
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in OURS:
            module = importlib.import_module(node.module)
            for a in node.names:
                if not hasattr(module, a.name):
                    try:
                        importlib.import_module(f"{node.module}.{a.name}")
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    except ImportError:
                        missing.append(f"{path.name}:{node.lineno} from {node.module} import {a.name}")
                elif isinstance(getattr(module, a.name), type(importlib)):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            module = importlib.import_module(aliases[node.value.id])
            if not hasattr(module, node.attr):
                missing.append(f"{path.name}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    return missing


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_every_name_a_benchmark_takes_from_infinity_exists(path):
    assert not _missing_names(path)


def test_the_check_finds_a_moved_name(tmp_path):
    """Planted: the call that broke the fault soak is found, at any depth."""
    probe = tmp_path / "probe.py"
    probe.write_text("def worker():\n    import infinity.state.checkpoint as ckpt\n    return ckpt.read_manifest('x')\n"
                     "def other():\n    from infinity.state.checkpoint import read_manifest\n")
    found = _missing_names(probe)
    assert len(found) == 2 and all("read_manifest" in f for f in found), found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_script_starts(path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.slow
def test_the_fault_soak_passes_at_a_small_size(tmp_path):
    """`bench_soak.py --faults` at 60 steps and 2 kills: background saves on a tmpfs filled to ENOSPC, the job
    SIGKILLed and resumed, the final parameters equal to an undisturbed run's bit for bit (its own assertion and
    the JSON's)."""
    import json
    if os.geteuid() != 0:
        pytest.skip("the fault soak mounts a tmpfs: it runs as root (as CI does)")
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(BENCH / "bench_soak.py"), "--faults", "--steps", "60", "--kills", "2",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["bitwise_equal"] and result["kills"] == 2 and result["max_abs_diff"] == 0.0, result
