"""The `infinity` command line: config, estimate, bench-links, bench-io, errors and exit codes."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tomllib

import pytest
import torch.nn as nn

from infinity.config.job import JOB_SECTIONS, ModelConfig
from infinity.config.sections import Config, ConfigError
from infinity.job.cli import EXIT_USAGE, main
from infinity.job.spec import DECAY_DEFAULTS, TRAIN_DEFAULTS, load_job
from infinity.machine import link_rates
from infinity.memory.cost_model import LinkRates

FAKE_RATES = LinkRates(nvme_read=2e9, nvme_write=1e9, cpu_adam=5e8, device_adam=5e8, matmul_flops=1e11,
                       source="measured (fake)")
SMALL = ["--set", "model.n_layer=2", "--set", "model.d_model=32", "--set", "model.n_head=2"]


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """One cache per module (the runtime RSS probe runs once); link rates are never really measured here."""
    mp = pytest.MonkeyPatch()
    mp.setenv("INFINITY_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    mp.setattr(link_rates, "measure_link_rates", lambda *a, **k: FAKE_RATES)
    yield
    mp.undo()


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_config_defaults_prints_every_key_with_its_default_and_meaning(capsys, tmp_path):
    """Every engine key with its meaning, commented out: a job file copied from it trains the job `infinity train`
    runs without one (its engine keys uncommented overrode the job's defaults: lr, schedule, placement,
    profiler, and a pretrained model's fine-tuning defaults)."""
    code, out, _ = run(capsys, "config", "--defaults")
    assert code == 0
    parsed = tomllib.loads(out)
    assert not any(table for section, table in parsed.items() if section not in JOB_SECTIONS)  # only headers
    (tmp_path / "job.toml").write_text(out)
    assert load_job(tmp_path / "job.toml").engine_config("r") == load_job(None).engine_config("r")
    key_line = re.compile(r"^# ([a-z_][a-z0-9_]*) = ")
    uncommented = tomllib.loads("\n".join(line[2:] if key_line.match(line) else line for line in out.splitlines()))
    for key, _type, default, help_text in Config.reference():
        section, name = key.split(".")
        expected = TRAIN_DEFAULTS.get(section, {}).get(name, DECAY_DEFAULTS.get(name, default)
                                                       if section == "optimizer" else default)
        assert uncommented[section][name] == expected, key
        assert help_text.split()[0] in out, key
    for section, cls in JOB_SECTIONS.items():
        table, shown = parsed, uncommented
        for part in section.split("."):  # [model.lora] is a table inside [model]
            table, shown = table[part], shown[part]
        # the built-in model's shape keys commented out: a copy given model.pretrained stays valid (Note [pretrained
        # shape keys]), and without it they are the defaults
        commented = set(ModelConfig.SHAPE) if cls is ModelConfig else set()
        assert {k for k, v in table.items() if not isinstance(v, dict)} == {
            f.name for f in dataclasses.fields(cls)} - commented
        assert {k: shown[k] for k in commented} == {f.name: f.default for f in dataclasses.fields(cls)
                                                    if f.name in commented}


def test_config_shows_the_resolved_job(capsys):
    code, out, _ = run(capsys, "config", "--set", "run.steps=12", "--set", "optimizer.lr=1e-3")
    parsed = tomllib.loads(out)
    assert code == 0 and parsed["run"]["steps"] == 12 and parsed["optimizer"]["lr"] == 1e-3
    assert parsed["optimizer"]["total_steps"] == 12 and parsed["placement"]["params"] == "nvme"


def test_a_decay_key_set_without_a_schedule_is_kept_and_checked():
    # the job's cosine default used to overwrite min_lr_ratio: --set optimizer.min_lr_ratio=0.5 trained to 10%
    # of lr, and 1.5 (over lr) passed unchecked
    opt = load_job(None, ["optimizer.min_lr_ratio=0.5"]).engine_config("r").optimizer
    assert (opt.schedule, opt.min_lr_ratio) == ("cosine", 0.5)
    assert load_job(None).engine_config("r").optimizer.min_lr_ratio == DECAY_DEFAULTS["min_lr_ratio"]
    with pytest.raises(ConfigError, match="optimizer.min_lr_ratio = 1.5: must be <= 1.0"):
        load_job(None, ["optimizer.min_lr_ratio=1.5"]).engine_config("r")


@pytest.mark.parametrize("argv,needle", [
    (["train", "--set", "run.stepz=3"], "run.stepz"),
    (["estimate", "--set", "placement.params=disk"], "placement.params"),
    (["config", "--config", "/nonexistent.toml"], "cannot read it"),
    (["estimate", "--world-size", "3"], "run.batch_size = 16 is not divisible by --world-size 3"),
    (["estimate", "--model", "no_such_module:build"], "--model no_such_module:build: cannot load it"),
])
def test_user_errors_print_the_key_and_exit_2(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == EXIT_USAGE and needle in err and "error:" in err


def test_estimate_json_has_bytes_plan_time_and_checks(capsys, tmp_path):
    code, out, _ = run(capsys, "estimate", "--json", *SMALL, "--set", f"run.dir={tmp_path}")
    data = json.loads(out)
    assert code == 0 and data["ok"]
    assert set(data["state"]) == {"device", "host", "nvme"} and data["state"]["nvme"]["exp_avg"] > 0
    assert data["step_time"]["total_s"] > 0 and data["traffic_per_step"]["nvme_read"] > 0
    assert {c["name"] for c in data["checks"]} >= {"placement fits the budgets", "free RAM", "locked memory"}


def test_estimate_world_size_splits_the_state(capsys, tmp_path):
    sizes = []
    for world in ("1", "4"):
        code, out, _ = run(capsys, "estimate", "--json", "--world-size", world, *SMALL, "--set", f"run.dir={tmp_path}")
        sizes.append(sum(sum(k.values()) for k in json.loads(out)["state"].values()))
    assert sizes[0] / 4 <= sizes[1] <= sizes[0] / 4 + 5 * 20 * 4  # each unit padded to a multiple of 4


def test_estimate_explain_and_a_failing_preflight(capsys, tmp_path):
    code, out, _ = run(capsys, "estimate", "--explain", *SMALL, "--set", "placement.policy=auto", "--set",
                       f"run.dir={tmp_path}")
    assert code == 0 and "blocks.1 (" in out and "optimizer on" in out
    code, out, _ = run(capsys, "estimate", *SMALL, "--set", "memory.device_budget=1KiB", "--set",
                       "memory.host_budget=1KiB", "--set", f"run.dir={tmp_path}")
    assert code == 1 and "[FAIL] placement fits the budgets" in out and "fix:" in out


def tiny_mlp() -> nn.Module:
    """A plain model for `--model test_cli:tiny_mlp`: embedding, a ModuleList of blocks, a head."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                        for _ in range(3))
            self.head = nn.Linear(32, 256)

        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)
    return Net()


def test_estimate_a_model_from_a_python_function(capsys, tmp_path):
    code, out, _ = run(capsys, "estimate", "--json", "--model", "test_cli:tiny_mlp", "--set", f"run.dir={tmp_path}")
    data = json.loads(out)
    params = sum(p.numel() for p in tiny_mlp().parameters())
    assert code == 0 and data["num_params"] == params and data["units"] == 4
    assert data["flops_per_step"] > 0 and data["activations_bytes"] > 0


def test_bench_links_measures_once_and_caches(capsys, tmp_path):
    code, out, _ = run(capsys, "bench-links", "--json", "--dir", str(tmp_path))
    assert code == 0 and json.loads(out)["nvme_read"] == FAKE_RATES.nvme_read
    code, out, _ = run(capsys, "bench-links", "--dir", str(tmp_path))
    assert code == 0 and "nvme read" in out and "measured (fake)" in out
    assert link_rates.cache_path().exists()


def test_module_entry_point_and_bench_io_passthrough():
    out = subprocess.run([sys.executable, "-m", "infinity", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "train" in out.stdout and "estimate" in out.stdout
    out = subprocess.run([sys.executable, "-m", "infinity", "bench-io", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--dir" in out.stdout


INTERRUPT_TORCH = """
import sys
class Interrupt:  # Ctrl-C arriving while torch loads
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
import infinity, infinity.config.sections, infinity.job.cli, io_engine.sizes
assert "torch" not in sys.modules, "importing the package, its config or its command loaded torch"
sys.exit(infinity.job.cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["train"], ["estimate"], ["config"]])
def test_a_ctrl_c_while_torch_loads_exits_130_without_a_traceback(argv, tmp_path):
    """Note [light package import]: the command parses its arguments before torch loads, and a KeyboardInterrupt
    from torch's import (the first ~1.3 s of every command) is the clean "interrupted" exit, not a traceback."""
    out = subprocess.run([sys.executable, "-c", INTERRUPT_TORCH, *argv], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 130, out.stderr
    assert out.stderr.strip() == f"infinity {argv[0]}: interrupted"


def test_the_package_names_load_on_first_use():
    import infinity
    import io_engine
    from infinity.runtime.engine import initialize
    assert infinity.initialize is initialize and "initialize" in dir(infinity) and "Config" in infinity.__all__
    assert io_engine.parse_size("1 KiB") == 1024
    with pytest.raises(AttributeError, match="no attribute 'initialise'"):
        infinity.initialise


def test_a_setting_that_does_nothing_is_one_line_other_warnings_as_python_prints_them(capsys, monkeypatch):
    """Note [inert setting]: the engine's SettingWarning (tests/optim/test_device_lane.py) reaches the user of
    the command as one line naming the command; any other warning keeps Python's format."""
    import warnings

    from infinity.config.sections import SettingWarning
    from infinity.job import cli

    def dispatch(args):
        warnings.warn('overlap.device_lane = "on": nothing is updated on the GPU', SettingWarning, stacklevel=2)
        warnings.warn("something else", UserWarning, stacklevel=2)
        again()  # (the same warning from another place: the job reads its config twice; said once)
        return 0

    def again():
        warnings.warn('overlap.device_lane = "on": nothing is updated on the GPU', SettingWarning, stacklevel=1)
    monkeypatch.setattr(cli, "_dispatch", dispatch)
    with pytest.warns(UserWarning, match="something else") as other:  # (pytest records what Python would print)
        code, _, err = run(capsys, "train")
    assert code == 0 and [w.category for w in other] == [UserWarning]
    assert err.splitlines() == ['infinity train: warning: overlap.device_lane = "on": nothing is updated on the GPU']
    monkeypatch.setenv("RANK", "1")  # (the other ranks of a torchrun job: said once, by rank 0)
    with pytest.warns(UserWarning, match="something else"):
        code, _, err = run(capsys, "train")
    assert code == 0 and err == ""
