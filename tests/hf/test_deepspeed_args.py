"""InfinityTrainingArguments(deepspeed=...): a DeepSpeed config through InfinityTrainer, against transformers' Trainer
run with the same settings written as TrainingArguments (the placement it says read from the engine's config)."""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from infinity.config.sections import ConfigError  # noqa: E402
from infinity.hf import InfinityTrainer, InfinityTrainingArguments  # noqa: E402
from infinity.hf.deepspeed import DeepSpeedPlan, deepspeed_schedule, plan_for  # noqa: E402

VOCAB = 64
STEPS = 8


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def lm_dataset(n, length=12):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (length,), generator=g).tolist() for _ in range(n)]
    return datasets.Dataset.from_list([{"input_ids": r, "labels": r} for r in rows])


COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.05,
              adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, max_steps=STEPS, logging_steps=1,
              save_strategy="no", report_to=[], seed=7, use_cpu=True, disable_tqdm=True, dataloader_drop_last=True)


def zero3(swap, **over):
    """ZeRO-3, parameters on NVMe, optimizer on the CPU, clipping 1.0, AdamW, WarmupLR (linear, 3 steps)."""
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(swap)},
                                "offload_optimizer": {"device": "cpu"}},
          "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.05}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 3,
                                                        "warmup_type": "linear"}}}
    ds.update(over)
    return ds


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_a_zero3_config_trains_as_it_says(tmp_path):
    """The bar: the engine's config has the placement, stage and clipping the DeepSpeed config says, and the losses,
    learning rates and grad norms equal transformers' Trainer's with the same settings as TrainingArguments
    (WarmupLR linear over 3 steps = constant_with_warmup, warmup_steps=3). The DeepSpeed config is a JSON file."""
    swap = tmp_path / "swap"
    swap.mkdir()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(zero3(swap)))
    train = lm_dataset(4 * STEPS)
    ref = Trainer(model=tiny_llama(), train_dataset=train,
                  args=TrainingArguments(output_dir=str(tmp_path / "ref"), lr_scheduler_type="constant_with_warmup",
                                         warmup_steps=3, **COMMON))
    ref.train()
    args = InfinityTrainingArguments(output_dir=str(tmp_path / "ours"), deepspeed=str(path), warmup_steps=3,
                                     **COMMON)  # (lr_scheduler_type stays "linear": the DeepSpeed scheduler wins)
    assert args.deepspeed is None and args.infinity_deepspeed == str(path)
    ours = InfinityTrainer(model=tiny_llama(), args=args, train_dataset=train)
    cfg = ours.engine.config
    assert (cfg.zero.stage, cfg.placement.params, cfg.placement.optimizer, cfg.placement.grads) == (3, "nvme", "host",
                                                                                                   "host")
    assert list(cfg.nvme.paths) == [str(swap)]
    assert cfg.optimizer.grad_clip == 1.0 and cfg.optimizer.name == "adamw" and cfg.train.grad_accum_steps == 2
    ours.train()
    assert len(logged(ref, "loss")) == STEPS
    assert logged(ours, "learning_rate") == pytest.approx(logged(ref, "learning_rate"), rel=1e-12)
    assert logged(ours, "learning_rate")[:4] == pytest.approx([0.0, 1e-3, 2e-3, 3e-3])  # DeepSpeed's linear warmup
    torch.testing.assert_close(torch.tensor(logged(ours, "loss")), torch.tensor(logged(ref, "loss")), rtol=1e-5,
                               atol=0)
    torch.testing.assert_close(torch.tensor(logged(ours, "grad_norm")), torch.tensor(logged(ref, "grad_norm")),
                               rtol=1e-4, atol=0)
    ours.engine.close()


def args_with(ds, **over):
    return InfinityTrainingArguments(output_dir="unused", deepspeed=ds, **{**COMMON, **over})


def test_auto_values_take_the_arguments(tmp_path):
    """"auto" resolves from the TrainingArguments as transformers resolves it, the step counts when the Trainer
    knows them (warmup: max(1, the arguments' warmup steps))."""
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                            "warmup_type": "linear"}}}
    args = args_with(ds, warmup_steps=0.25)
    plan = args.deepspeed_plan
    assert plan.config["train_batch_size"] == 4 and plan.config["gradient_clipping"] == 1.0
    assert plan.config["optimizer"]["params"] == {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.05}
    assert plan.engine_sets == {"zero.stage": 2, "placement.optimizer": "host", "placement.grads": "host",
                                "optimizer.name": "adamw"}
    factor = deepspeed_schedule(plan, args, 8)
    assert plan.config["scheduler"]["params"]["warmup_num_steps"] == 2  # ceil(8 x 0.25)
    assert plan.config["scheduler"]["params"]["total_num_steps"] == 8
    # WarmupDecayLR: transformers' "linear" schedule with the same warmup
    ref = transformers.get_scheduler("linear", torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                                     num_warmup_steps=2, num_training_steps=8)
    expected = []
    for _ in range(8):
        expected.append(ref.get_last_lr()[0])
        ref.optimizer.step()
        ref.step()
    assert [factor(s) for s in range(8)] == pytest.approx(expected, abs=1e-12)


def test_warmup_cosine_follows_deepspeeds_curve():
    """WarmupCosineLR: linear warmup, then cosine from the first step after warmup counted as 1 (DeepSpeed's
    WarmupCosineLR) down to cos_min_ratio at total_num_steps."""
    plan = DeepSpeedPlan(config={"scheduler": {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": 2, "total_num_steps": 6, "cos_min_ratio": 0.1, "warmup_type": "linear"}}},
        translation=None, engine_sets={}, scheduler=None)
    plan.scheduler = plan.config["scheduler"]
    args = TrainingArguments(output_dir="unused", warmup_steps=2, report_to=[], use_cpu=True)
    factor = deepspeed_schedule(plan, args, 6)
    cos = [0.1 + 0.9 * (1 + torch.cos(torch.tensor(torch.pi * k / 4)).item()) / 2 for k in (1, 2, 3, 4)]
    assert [factor(s) for s in range(6)] == pytest.approx([0.0, 0.5] + cos, abs=1e-7)


def test_a_value_unlike_the_arguments_is_refused():
    """A non-"auto" value must equal the argument's, as transformers' DeepSpeed integration requires."""
    with pytest.raises(ConfigError, match=r"gradient_clipping = 0.5 vs TrainingArguments max_grad_norm = 1.0"):
        args_with({"gradient_clipping": 0.5})
    with pytest.raises(ConfigError, match=r"optimizer.params.lr = 0.1 vs TrainingArguments learning_rate"):
        args_with({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})


def test_keys_it_cannot_honour_are_named_and_lenient_trains_without_them(tmp_path, capsys):
    ds = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "sub_group_size": 1e9},
          "gradient_clipping": 1.0}
    with pytest.raises(ConfigError, match=r"2 DeepSpeed key\(s\) infinity cannot honour: "
                                          r"zero_optimization.stage3_max_live_parameters = .*deepspeed_lenient=True"):
        args_with(ds)
    args = args_with(ds, deepspeed_lenient=True)
    out = capsys.readouterr().out
    assert "deepspeed: zero_optimization.stage = 3 -> zero.stage = 3" in out
    assert "deepspeed: not honoured (deepspeed_lenient=True): zero_optimization.sub_group_size" in out
    assert args.deepspeed_plan.engine_sets == {"zero.stage": 3}


def test_plain_training_arguments_and_conflicts_are_refused(tmp_path):
    """An infinity_config that sets a key the DeepSpeed config sets otherwise is refused; a bad path is named."""
    args = args_with({"zero_optimization": {"stage": 3}})
    with pytest.raises(ConfigError, match=r"infinity_config sets zero.stage = 1 but TrainingArguments\(deepspeed="):
        InfinityTrainer(model=tiny_llama(), args=args, train_dataset=lm_dataset(4),
                        infinity_config={"zero": {"stage": 1}})
    with pytest.raises(ConfigError, match=r"deepspeed='nope.json'\): cannot read it"):
        plan_for(args, "nope.json", lenient=False)


def test_sft_config_takes_deepspeed_too():
    """TRL's SFTConfig twin: the same deepspeed= (its bf16=True default resolves "auto")."""
    pytest.importorskip("trl")
    from infinity.hf import InfinitySFTConfig
    args = InfinitySFTConfig(output_dir="unused", deepspeed={"bf16": {"enabled": "auto"}, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}}}, report_to=[], use_cpu=True)
    assert args.deepspeed is None and args.deepspeed_plan.config["bf16"]["enabled"] is True
    assert args.deepspeed_plan.engine_sets == {"zero.stage": 3, "placement.params": "host"}


def test_transformers_style_zero3_config(capsys):
    """A config as transformers' DeepSpeed examples write them: fp16 "auto" (off here, so its loss-scale keys do
    nothing), "auto" bucket sizes (the runtime's choice: infinity's plan), WarmupLR with DeepSpeed's default log
    warmup (run as DeepSpeed's curve); its numeric tuning knobs are named and refused unless lenient."""
    ds = {"fp16": {"enabled": "auto", "loss_scale": 0, "hysteresis": 2, "initial_scale_power": 16},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto"}}}
    with pytest.raises(ConfigError, match=r"1 DeepSpeed key\(s\) infinity cannot honour: "
                                          r"zero_optimization.stage3_max_live_parameters = 1000000000.0"):
        args_with(ds)
    args = args_with(ds, deepspeed_lenient=True, warmup_steps=4)
    out = capsys.readouterr().out
    assert "deepspeed: fp16.{hysteresis, initial_scale_power, loss_scale} -> nothing to set (fp16 is off)" in out
    assert 'deepspeed: zero_optimization.reduce_bucket_size = "auto" -> nothing to set' in out
    factor = deepspeed_schedule(args.deepspeed_plan, args, 10)
    expected = [math.log(s + 1) / math.log(4) for s in range(4)] + [1.0] * 6
    assert [factor(s) for s in range(10)] == pytest.approx(expected, abs=1e-12)


def test_unknown_scheduler_parameters_are_named():
    ds = {"scheduler": {"type": "OneCycle", "params": {}}}
    with pytest.raises(ConfigError, match=r'scheduler.type = "OneCycle": the schedules run are WarmupLR'):
        args_with(ds)
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear", "gamma": 0.5}}}
    with pytest.raises(ConfigError, match=r"scheduler.params.gamma = 0.5: not a parameter of DeepSpeed's WarmupLR"):
        args_with(ds)
