"""Note [deepspeed translation]: a DeepSpeed config becomes infinity's keys (each printed), and every key infinity
cannot honour is named with its reason and refused unless --deepspeed-lenient. The reference for the run: the
placement, clipping, learning rates and batch the DeepSpeed config says, read back from the run's own records."""

from __future__ import annotations

import json

import pytest

from infinity.config.deepspeed import translate
from infinity.config.sections import ConfigError
from infinity.job.cli import main

ZERO3 = {  # ZeRO-3, parameters on NVMe, optimizer in CPU memory, clip 1.0, AdamW, linear WarmupLR
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "SWAP", "pin_memory": True},
                          "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True},
    "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 3,
                                                 "warmup_type": "linear"}},
}
TINY = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16", "run.eval_batches=1",
        "run.eval_every=0", "run.steps=5", "profile.enabled=false"]



def test_the_zero3_offload_config_translates_key_by_key():
    t = translate(ZERO3, world_size=2)
    assert not t.refused, t.refused
    sets = dict(s.split("=", 1) for s in t.sets)
    assert {k: json.loads(v) for k, v in sets.items()} == {
        "zero.stage": 3, "placement.params": "nvme", "placement.optimizer": "host", "placement.grads": "host",
        "nvme.paths": ["SWAP"], "optimizer.grad_clip": 1.0, "train.grad_accum_steps": 2, "run.batch_size": 8,
        "optimizer.name": "adamw", "optimizer.lr": 2e-3, "optimizer.betas": [0.9, 0.95], "optimizer.eps": 1e-8,
        "optimizer.weight_decay": 0.01, "optimizer.warmup_steps": 3, "optimizer.schedule": "constant"}
    assert any(line.startswith("zero_optimization.overlap_comm = true -> nothing to set") for line in t.lines)


@pytest.mark.parametrize("patch, named", [
    ({"zero_optimization": {"stage": 3, "sub_group_size": 1e9}}, "zero_optimization.sub_group_size"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}, "scheduler.params.warmup_type"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, "train_batch_size"),
    ({"tensorboard": {"enabled": True}}, "tensorboard.enabled"),
])
def test_every_key_it_cannot_honour_is_named_with_its_reason(patch, named):
    t = translate(patch)
    assert [r for r in t.refused if r.startswith(named)], t.refused


def test_an_auto_tuning_knob_is_left_to_infinity_not_refused():
    """The HF integration's ZeRO-3 template writes "auto" bucket sizes: `infinity train --deepspeed` takes them as
    the HF route does (infinity's own sizing, a line each), while a number for the same key is still refused.
    Planted: the "auto" branch removed -> the three keys are refused, the test fails."""
    knobs = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
             "stage3_param_persistence_threshold": "auto"}
    t = translate({"zero_optimization": {"stage": 3, **knobs}})
    assert not t.refused, t.refused
    assert sum("= \"auto\" -> nothing to set (infinity chooses its own" in line for line in t.lines) == 3, t.lines
    assert translate({"zero_optimization": {"reduce_bucket_size": 5e8}}).refused


def test_deepspeed_adam_is_adamw_unless_adam_w_mode_is_false():
    assert "optimizer.name=\"adamw\"" in translate({"optimizer": {"type": "Adam", "params": {}}}).sets
    assert "optimizer.name=\"adam\"" in translate({"optimizer": {"type": "Adam",
                                                                 "params": {"adam_w_mode": False}}}).sets


def test_infinity_train_deepspeed_trains_as_the_config_says(tmp_path, capsys):
    swap = tmp_path / "swap"
    swap.mkdir()
    ds = json.loads(json.dumps(ZERO3).replace("SWAP", str(swap)))
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    sets = [a for s in TINY + [f"run.dir={tmp_path}", "run.name=r"] for a in ("--set", s)]
    assert main(["train", "--quiet", "--deepspeed", str(tmp_path / "ds.json"), *sets]) == 0
    out = capsys.readouterr().out
    assert "deepspeed: gradient_clipping = 1.0 -> optimizer.grad_clip = 1.0" in out
    run = tmp_path / "r"
    config = (run / "config.toml").read_text()
    for line in ('params = "nvme"', 'optimizer = "host"', "grad_clip = 1.0", "grad_accum_steps = 2",
                 "batch_size = 4", f'paths = ["{swap}"]'):
        assert line in config, line
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records] == pytest.approx([2e-3 * 1 / 3, 2e-3 * 2 / 3, 2e-3, 2e-3, 2e-3])
    state = json.loads((run / "memory_report.json").read_text())["state"]  # where the engine really put it
    assert state["nvme"]["params"] > 0 and state["host"]["exp_avg"] > 0 and state["host"]["grads"] > 0
    assert state["device"]["params"] == state["device"]["exp_avg"] == 0


def test_a_refused_key_stops_the_run_unless_lenient(tmp_path, capsys):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9},
                                                  "gradient_clipping": 0.5}))
    sets = [a for s in TINY + [f"run.dir={tmp_path}", "run.name=r", "run.steps=1"] for a in ("--set", s)]
    with pytest.raises(ConfigError, match=r"1 DeepSpeed key\(s\) infinity cannot honour: zero_optimization."
                                          r"stage3_max_live_parameters = .*--deepspeed-lenient"):
        from infinity.job import cli
        cli._line(cli.build_parser().parse_args(["train", "--deepspeed", str(tmp_path / "ds.json")]))
    assert main(["train", "--quiet", "--deepspeed", str(tmp_path / "ds.json"), "--deepspeed-lenient", *sets]) == 0
    out = capsys.readouterr().out
    assert "not honoured (--deepspeed-lenient): zero_optimization.stage3_max_live_parameters" in out
    assert "stage = 2" in (tmp_path / "r" / "config.toml").read_text()
