"""`infinity estimate` against what the engine really does: bytes per tier, peak RSS, preflight checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import infinity
from dist_utils import run_distributed
from engine_runs import ALL_PLACEMENTS
from infinity.config.job import ModelConfig
from infinity.job.spec import load_job
from infinity.machine import preflight as pf
from infinity.memory.cost_model import LinkRates
from infinity.memory.plan import Budgets
from infinity.models.build import build_model
from infinity.plan import estimate as est

RATES = LinkRates(nvme_read=2e9, nvme_write=1e9, cpu_adam=5e8, device_adam=5e8, matmul_flops=1e11, source="test")
SMALL = ModelConfig(n_layer=2, d_model=48, n_head=4, seq_len=16, vocab_size=300)  # odd sizes: padding shows




def engine_config(placement: dict, swap: str) -> infinity.Config:
    return infinity.Config.from_dict({"placement": placement, "nvme": {"paths": [swap]}})


def within(predicted: int, actual: int, rel: float) -> bool:
    return abs(predicted - actual) <= rel * max(actual, 1)


@pytest.mark.parametrize("placement", ALL_PLACEMENTS + [{"policy": "auto"}], ids=lambda p: "-".join(p.values()))
def test_estimate_predicts_each_tiers_bytes(placement, tmp_path):
    config = engine_config(placement, str(tmp_path))
    predicted = est.estimate(lambda: build_model(SMALL), config, batch_size=2, seq_len=SMALL.seq_len, rates=RATES)
    bundle = build_model(SMALL)
    with infinity.initialize(bundle.model, config, init_fn=bundle.init_fn) as engine:
        report = engine.memory_report()
    assert predicted.state() == report["state"]  # exact, which is within 5% per tier and kind
    # and both against the formula: every kind is 4 bytes (fp32) per parameter, on the tier the placement
    # names, within 5% for padding; fp32 parameters on NVMe with the optimizer are the master's bytes
    n = sum(p.numel() for p in {id(p): p for p in bundle.model.parameters()}.values())
    group = {"params": "params", "grads": "grads", "master": "optimizer", "exp_avg": "optimizer",
             "exp_avg_sq": "optimizer"}
    aliased = placement.get("params") == placement.get("optimizer") == "nvme"
    for kind, where in group.items():
        expected = 0 if kind == "params" and aliased else 4 * n
        on = {tier: predicted.state()[tier][kind] for tier in predicted.state()}
        assert within(sum(on.values()), expected, 0.05), (kind, on, expected)
        if "policy" not in placement:
            assert within(on[placement[where]], expected, 0.05), (kind, on, placement)


WS2_PLACEMENTS = [{"params": p, "grads": g, "optimizer": o}  # every tier once for each kind, mixed
                  for p, g, o in (("device", "host", "nvme"), ("host", "nvme", "device"), ("nvme", "device", "host"))]


def _ws2_reports(rank, world, swap_root):
    out = []
    for i, placement in enumerate(WS2_PLACEMENTS):
        bundle = build_model(SMALL)
        with infinity.initialize(bundle.model, engine_config(placement, f"{swap_root}/{i}")) as engine:
            out.append(engine.memory_report()["state"])
    return out


def test_estimate_per_rank_bytes_at_world_size_2(tmp_path):
    for i in range(len(WS2_PLACEMENTS)):
        os.makedirs(tmp_path / str(i), exist_ok=True)
    per_rank = run_distributed(_ws2_reports, 2, str(tmp_path))
    for i, placement in enumerate(WS2_PLACEMENTS):
        predicted = est.estimate(lambda: build_model(SMALL), engine_config(placement, str(tmp_path / str(i))),
                                 world_size=2, batch_size=1, seq_len=SMALL.seq_len, rates=RATES).state()
        assert predicted == per_rank[0][i] == per_rank[1][i], placement


# ---------------------------------------------------------------- peak memory

STATE_HEAVY = ["model.n_layer=6", "model.d_model=384", "model.n_head=6", "model.seq_len=64", "run.batch_size=4"]
RSS_CASES = {
    "all-device": STATE_HEAVY + ["placement.params=device", "placement.grads=device", "placement.optimizer=device"],
    "all-nvme": STATE_HEAVY + ["placement.params=nvme", "placement.grads=nvme", "placement.optimizer=nvme"],
    "host-device-nvme": STATE_HEAVY + ["placement.params=host", "placement.grads=device", "placement.optimizer=nvme"],
    "default-job": [],
}


@pytest.mark.parametrize("pair", [("all-nvme", "default-job"),
                                  pytest.param(("all-device", "host-device-nvme"), marks=pytest.mark.slow)],
                         ids=lambda p: "+".join(p))
def test_estimate_predicts_the_measured_peak_rss(pair, tmp_path):
    """Each case trains 3 steps in a fresh process (`infinity train`), the pair side by side (one per core);
    its peak RSS is within 15% of the prediction (Note [peak memory] in infinity/memory/traffic.py)."""
    runs = {}
    for name in pair:
        overrides = RSS_CASES[name]
        overrides = overrides + [f"run.dir={tmp_path}", f"run.name={name}", "run.steps=3", "run.eval_batches=1",
                                 "run.checkpoint=false"]
        job = load_job(None, overrides)
        config = job.engine_config(str(tmp_path / name))
        runs[name] = (job, config, overrides)
    predictions = {name: est.estimate(lambda job=job: build_model(job.model), config, batch_size=job.run.batch_size,
                                      seq_len=job.model.seq_len, rates=RATES).peak["ram"]
                   for name, (job, config, _) in runs.items()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "infinity", "train", "--quiet"]
                              + [a for o in runs[n][2] for a in ("--set", o)], env=env, stderr=subprocess.PIPE,
                              text=True) for n in pair]
    for p in procs:
        assert p.wait(timeout=240) == 0, p.stderr.read()
    for name in pair:
        measured = json.loads((tmp_path / name / "summary.json").read_text())["peak_rss_bytes"]
        assert within(predictions[name], measured, 0.15), (name, predictions[name] >> 20, measured >> 20)


# ---------------------------------------------------------------- preflight


def test_preflight_passes_on_a_config_that_fits(tmp_path):
    config = engine_config({"params": "nvme", "grads": "host", "optimizer": "nvme"}, str(tmp_path))
    result = est.estimate(lambda: build_model(SMALL), config, batch_size=2, seq_len=16, rates=RATES)
    assert result.ok
    names = [c.name for c in result.checks]
    assert "free RAM" in names and "locked memory" in names and any(n.startswith("free disk on") for n in names)


def test_placement_that_does_not_fit_fails_with_the_fix(tmp_path):
    config = infinity.Config.from_dict({"memory": {"device_budget": "1MiB", "host_budget": "1MiB"}})
    result = est.estimate(lambda: build_model(SMALL), config, batch_size=2, seq_len=16, rates=RATES)
    assert not result.ok
    failed = [c for c in result.checks if not c.ok]
    assert failed[0].name == "placement fits the budgets" and "memory.device_budget" in failed[0].detail
    with pytest.raises(infinity.PreflightError, match="placement fits the budgets"):
        pf.require(result.checks)


def test_more_ram_than_available_fails_with_the_fix(tmp_path):
    huge = "100TiB"
    config = infinity.Config.from_dict({"memory": {"device_budget": huge, "host_budget": huge}})
    budgets = Budgets(device=100 << 40, host=100 << 40, nvme=0, shared_ram=True)
    result = est.estimate(lambda: build_model(SMALL), config, batch_size=2, seq_len=16, rates=RATES, budgets=budgets,
                          cuda=False)
    ram = next(c for c in result.checks if c.name == "free RAM")
    assert ram.ok  # the model is small: the budget is only an upper bound
    checks = pf.preflight(result.plan, None, config, local_world_size=1, cuda=False, ram_per_rank=100 << 40)
    ram = next(c for c in checks if c.name == "free RAM")
    assert not ram.ok and "nvme" in ram.fix and "fewer ranks per node" in ram.fix


def test_disk_too_small_and_missing_path(tmp_path):
    checks, _ = pf.check_disks([str(tmp_path)], nvme_bytes=1 << 60, local_world_size=2)
    disk = next(c for c in checks if c.name.startswith("free disk"))
    assert not disk.ok and "2 rank(s)" in disk.detail and "nvme.paths" in disk.fix
    unwritable = tmp_path / "ro"
    unwritable.mkdir()
    if os.geteuid() == 0:  # root writes through permission bits (CI runs as root): a read-only filesystem binds
        from tmpfs import tmpfs
        with tmpfs(unwritable, "1m", readonly=True):
            assert not os.access(unwritable, os.W_OK)
            checks, _ = pf.check_disks([str(unwritable / "swap")], nvme_bytes=1, local_world_size=1)
        assert not checks[0].ok and "mkdir -p" in checks[0].fix, checks[0]
        return
    unwritable.chmod(0o500)
    try:
        checks, _ = pf.check_disks([str(unwritable / "swap")], nvme_bytes=1, local_world_size=1)
        assert not checks[0].ok and "mkdir -p" in checks[0].fix
    finally:
        unwritable.chmod(0o700)


def test_locked_memory_limit(monkeypatch):
    import resource
    monkeypatch.setattr(pf, "_has_cap_ipc_lock", lambda: False)
    monkeypatch.setattr(resource, "getrlimit", lambda what: (64 << 10, 64 << 10))
    check = pf.check_locked_memory(1 << 30, local_world_size=1)
    assert not check.ok and check.level == "warning" and "ulimit -l unlimited" in check.fix
    assert pf.check_locked_memory(4096, local_world_size=1).ok
    pf.require([check])  # a warning does not stop a run


def test_report_text_has_every_section(tmp_path):
    config = engine_config({"policy": "auto"}, str(tmp_path))
    text = est.format_estimate(est.estimate(lambda: build_model(SMALL), config, batch_size=2, seq_len=16,
                                            rates=RATES), explain=True)
    for needle in ("bytes per rank, per tier and state kind", "exp_avg_sq", "plan (policy auto)", "<root>",
                   "predicted step", "traffic per step", "predicted peak memory", "preflight:", "[ok  ]"):
        assert needle in text, needle


def test_activations_and_flops_are_traced_on_meta_tensors():
    bundle = build_model(SMALL)
    batch, seq = 3, SMALL.seq_len
    trace = est.trace_step(bundle.model, bundle.loss, batch, seq)
    assert trace.error is None
    params = sum(p.numel() for p in {id(p): p for p in build_model(SMALL).model.parameters()}.values())
    matmul_params = params - SMALL.seq_len * SMALL.d_model  # position embeddings are looked up, not multiplied
    assert trace.flops >= 6 * matmul_params * batch * seq * 0.9  # forward 2N + backward 4N per token, at least
    d = SMALL.d_model
    assert trace.activation_bytes >= SMALL.n_layer * batch * seq * d * 4 * 8  # a handful of [b, t, d] per block


def test_the_runtime_memory_is_measured_again_when_infinitys_code_changes(tmp_path, monkeypatch):
    """Note [peak memory] runtime: cached per machine, torch version and infinity's code (a cache measured
    before the code stopped importing torch._dynamo predicted the default job 22% high); --remeasure too."""
    from infinity.machine import link_rates
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path))
    measured = []

    def measure():
        measured.append(1)
        return 100 + len(measured)
    code = ["a"]
    monkeypatch.setattr(link_rates, "_code_fingerprint", lambda: code[0])
    assert [link_rates.cached_measurement("probe", measure, of_code=True) for _ in range(2)] == [101, 101]
    code[0] = "b"  # a source file changed
    assert link_rates.cached_measurement("probe", measure, of_code=True) == 102
    assert link_rates.cached_measurement("probe", measure, of_code=True, remeasure=True) == 103
    assert link_rates.cached_measurement("probe", measure) == 104  # (not of the code: a key of its own)
    monkeypatch.undo()
    first = link_rates._code_fingerprint()
    source = os.path.join(os.path.dirname(infinity.__file__), "plan", "estimate.py")
    stat = os.stat(source)
    try:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
        assert link_rates._code_fingerprint() != first
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert link_rates._code_fingerprint() == first
