"""Every benchmark script still starts after a move of modules: its `--help` runs (the module and its top-level
imports load, its arguments parse), and every name it takes from infinity or io_engine, at any depth (imports
inside functions, and attributes of an imported module: `ckpt.read_manifest`), exists where it takes it from.
Benchmarks are not in the suite's timed runs, so a moved function broke `bench_soak.py --faults` unnoticed
(`infinity.state.checkpoint.read_manifest`, moved to checkpoint_load). And every script runs at its smallest size
(the few with none: `--help`, and why), the fault soak too (30 steps, one kill)."""

from __future__ import annotations

import ast
import importlib
import json
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


# Each script's smallest real run, {dir} and {json} filled in (a run writes its JSON there): a real run also
# catches what --help cannot, a name used only once the work starts. Each takes a few seconds on 2 cores.
TINY = {
    "bench_cpu_adam.py": ["--json", "{json}", "--numel", "100000", "--param-numel", "100000", "--repeats", "1"],
    "bench_dma_memory.py": ["--dir", "{dir}", "--size", "1MiB", "--repeats", "1", "--json", "{json}"],
    "bench_export.py": ["--dir", "{dir}", "--layers", "1", "--d-model", "64", "--vocab", "256", "--json", "{json}"],
    "bench_gil.py": ["--dir", "{dir}", "--size", "64MiB", "--repeats", "1", "--intervals-us", "5000",
                     "--json", "{json}"],  # (64 MiB: it writes in 32 MiB requests)
    "bench_gpu.py": ["--tiny", "--device", "cpu", "--cases", "a", "--json", "{json}"],
    "bench_grad_sums.py": ["--dir", "{dir}", "--layers", "1", "--d-model", "64", "--accum", "2", "--windows", "2",
                           "--repeats", "1", "--json", "{json}"],
    "bench_out_of_core.py": ["--dir", "{dir}", "--layers", "1", "--d-model", "64", "--heads", "2", "--vocab", "256",
                             "--seq", "16", "--steps", "1", "--json", "{json}"],
    "bench_replay.py": ["--dir", "{dir}", "--layers", "1", "--d-model", "64", "--heads", "2", "--vocab", "256",
                        "--seq", "16", "--reps", "1", "--hog-threads", "1", "--json", "{json}"],
    "bench_soak.py": ["--steps", "20", "--warmup", "5", "--every", "5", "--save-every", "10", "--dir", "{dir}",
                      "--json", "{json}"],
    "bench_step.py": ["--dir", "{dir}", "--systems", "torch,infinity:device/host/host", "--layers", "1", "--d-model",
                      "64", "--heads", "2", "--vocab", "256", "--seq", "16", "--steps", "2", "--warmup", "1",
                      "--io-bytes", "1048576", "--io-sustained-bytes", "0", "--paired-blocks", "0", "--json",
                      "{json}"],
    "gpu_check_report.py": ["--logs", "{dir}", "--json", "{json}"],  # (no logs: every bar unmeasured)
}
# Smallest real runs over ~10 s (fresh processes importing transformers, or whole `infinity train` jobs): slow
SLOW_TINY = {
    "bench_compute_time.py": ["--shapes", "1x16x8x2x64", "--repeats", "1", "--json", "{json}"],  # (the runtime probe)
    "bench_chunked_loss.py": ["--vocab", "256", "--hidden", "16", "--seq", "16", "--chunk", "8", "--repeats", "1"],
    "bench_data.py": ["--dir", "{dir}", "--tokenize-mib", "1", "--sizes-mib", "2", "--files-mib", "1", "--repeats", "1",
                      "--steps", "1", "--json", "{json}"],  # (five `infinity train` jobs)
    "bench_compile.py": ["--layers", "1", "--width", "16", "--heads", "2", "--seq", "16", "--batch", "2", "--steps",
                         "2", "--warmup", "1", "--repeats", "1"],  # (inductor's first compile)
    "bench_estimate.py": ["--repeats", "1", "--json", "{json}"],  # (a 70B estimated twice, each its own process)
    "bench_finetune.py": ["--dir", "{dir}", "--hidden", "32", "--layers", "1", "--intermediate", "64", "--vocab",
                          "256", "--heads", "2", "--kv-heads", "1", "--steps", "1", "--seq", "8", "--shard-size",
                          "1MB", "--json", "{json}"],
    "bench_peak_rss.py": ["--dir", "{dir}/runs", "--steps", "2", "--repeats", "1", "--json", "{json}"],
    "bench_offload_bound.py": ["--tiny", "--device", "cpu", "--cases", "m1,m2", "--dir", "{dir}", "--json",
                               "{json}"],  # (d2 needs DeepSpeed)
    "largest_whatif.py": ["--machine", "h200", "--set", "run.batch_size=1", "--set", "precision.compute_dtype=bf16",
                          "--json", "{json}"],  # (~50 s: the ladder's estimates for a faked GPU machine)
}
HELP_ONLY = {  # script -> why it has no smaller real run here
    "bench_largest.py": "it trains the largest model `infinity estimate --largest` finds for the machine (a tiny "
                        "answer written by hand: test_bench_largest.py)",
    "pyspy_step.py": "it samples a step with py-spy, which CI does not install",
    "soak_faults.py": "the fault soak's worker and driver: run by bench_soak.py --faults (the tests below)",
}


def _run(path: Path, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(path), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_every_benchmark_script_has_a_start_here():
    """A new script gets its smallest run here (or the reason it has none): else it could break unseen."""
    names = {p.name for p in SCRIPTS}
    listed = set(TINY) | set(SLOW_TINY) | set(HELP_ONLY)
    assert names == listed, f"not listed: {sorted(names - listed)}; no such script: {sorted(listed - names)}"
    assert not set(TINY) & set(SLOW_TINY) and not (set(TINY) | set(SLOW_TINY)) & set(HELP_ONLY)


@pytest.mark.slow  # (20 s: the name check above is what catches a module move)
@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS))
def test_every_benchmark_script_starts(name):
    out = _run(BENCH / name, ["--help"], timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stdout[-2000:] + out.stderr[-2000:]


def _tiny(name: str, args: list[str], tmp_path: Path) -> None:
    out_json = tmp_path / "out.json"
    filled = [a.format(dir=tmp_path, json=out_json) for a in args]
    run = _run(BENCH / name, filled)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    if "{json}" in args:
        result = json.loads(out_json.read_text())
        assert isinstance(result, dict) and result, result


@pytest.mark.slow  # (45 s in all: the name check and --help above keep a module move from breaking one unseen)
@pytest.mark.parametrize("name", sorted(TINY))
def test_every_benchmark_runs_at_its_smallest_size(name, tmp_path):
    _tiny(name, TINY[name], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_TINY))
def test_the_slower_benchmarks_run_at_their_smallest_size(name, tmp_path):
    _tiny(name, SLOW_TINY[name], tmp_path)


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.sh")), ids=lambda p: p.name)
def test_every_shell_script_parses(path):
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _soak(tmp_path: Path, steps: int, kills: int) -> dict:
    if os.geteuid() != 0:
        pytest.skip("the fault soak mounts a tmpfs: it runs as root (as CI does)")
    out = tmp_path / "soak.json"
    run = _run(BENCH / "bench_soak.py", ["--faults", "--steps", str(steps), "--kills", str(kills), "--json", str(out)],
               timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["bitwise_equal"] and result["kills"] == kills and result["max_abs_diff"] == 0.0, result
    assert len(result["resumed_from"]) == kills + 1, result  # started again after each kill (from the newest
    # checkpoint, or from step 0 when the full disk had failed every save before the kill)
    return result


@pytest.mark.slow
def test_the_fault_soak_passes_at_its_smallest_size(tmp_path):
    """`bench_soak.py --faults` at 30 steps and 1 kill (about 15 s): background saves on a tmpfs filled to ENOSPC,
    the job SIGKILLed and started again from its newest checkpoint, the final parameters equal to an undisturbed
    run's bit for bit (its own assertion and the JSON's)."""
    _soak(tmp_path, 30, 1)


@pytest.mark.slow
def test_the_fault_soak_passes_at_a_small_size(tmp_path):
    """The same at 60 steps and 2 kills (about 35 s)."""
    _soak(tmp_path, 60, 2)
