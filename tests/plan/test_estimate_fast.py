"""The estimate's fast paths give the same figures as the slow ones: Note [deepened estimate] (a model of L
repeating blocks estimated from its 2- and 3-block copies) against the model built and traced whole, Note
[estimator's Llama] against transformers' Llama, and the update-staging replay cut to its window (Note [working
memory]) against the replay of every chunk."""

from __future__ import annotations

import dataclasses
import random

import pytest

import infinity
from infinity.config.job import ModelConfig
from infinity.memory import traffic
from infinity.memory.cost_model import LinkRates
from infinity.memory.plan import Budgets
from infinity.models.build import build_model
from infinity.plan import estimate as est
from infinity.plan import probe
from infinity.plan.search import default_apply
from infinity.plan.traced import WORK_FIELDS, DeepenedModel, job_depth, model_facts

RATES = LinkRates(nvme_read=2e9, nvme_write=1e9, cpu_adam=5e8, device_adam=5e8, matmul_flops=1e11, source="test")
BIG = 1 << 50
CASES = {  # model, engine config
    "gpt, tiled, checkpointed": (
        ModelConfig(kind="gpt", n_layer=4, d_model=32, n_head=2, seq_len=16, vocab_size=256),
        {"placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"}, "units": {"tile_bytes": 8192},
         "activation": {"checkpoint": "units"}, "optimizer": {"sub_group_size": 1024}}),
    "llama": pytest.param(  # (slow: transformers' Llama; the default CI runs the GPT)
        ModelConfig(kind="llama", n_layer=6, d_model=32, n_head=4, n_kv_head=2, seq_len=16, vocab_size=256),
        {"placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"}, "units": {"tile_bytes": 8192},
         "activation": {"checkpoint": "units"}, "optimizer": {"sub_group_size": 1024}}, marks=pytest.mark.slow),
}


HOST_TIME = probe.host_time  # (the fixture below replaces it)


@pytest.fixture(autouse=True)
def fixed_runtime(monkeypatch):
    monkeypatch.setattr(probe, "runtime_rss", lambda *a, **k: 100 << 20)  # both paths: one constant
    monkeypatch.setattr(probe, "host_time", lambda units, *a, **k: (0.0, 0.0))  # no probe process
    monkeypatch.setattr(probe, "op_seconds", lambda *a, **k: 1e-5)


def run(model, config, *, deep, budgets=None, search=True, own_llama=False):
    return est.estimate(lambda: build_model(model), config, batch_size=2, seq_len=model.seq_len, rates=RATES,
                        cuda=False, budgets=budgets, apply=default_apply(config, 1, 2) if search else None,
                        depth=job_depth(model, own_llama=own_llama) if deep else None)


def figures(e, work: bool = True) -> dict:
    """`work`: with the trace's bytes and operations (Note [compute time]); without, the FLOPs alone."""
    rows = [(r.shape, r.stage, r.bytes, r.activations, r.over, round(r.step_s, 12)) for r in e.table]
    plans = [(p.sets, p.row.bytes, p.row.activations, round(p.row.step_s, 12), p.verdict.peak) for p in e.plans]
    trace = dataclasses.asdict(e.trace)
    for name in ("unit_names",) + (() if work else WORK_FIELDS):
        trace.pop(name)
    return {"params": e.num_params, "units": e.units, "groups": e.groups, "state": e.state(), "peak": e.peak,
            "trace": trace, "rows": rows, "plans": plans, "checks": [(c.name, c.ok) for c in e.checks]}


@pytest.mark.parametrize("search", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["figures", "search"])
@pytest.mark.parametrize("model, raw", CASES.values(), ids=CASES)
def test_deepened_estimate_equals_the_whole_model(model, raw, search, tmp_path):
    """Every figure, and with `search` the plans the plan search proposes (a function of those figures: slow, 30 s
    of the planner's local search twice)."""
    config = infinity.Config.from_dict({**raw, "nvme": {"paths": [str(tmp_path)]}})
    assert isinstance(model_facts(lambda: build_model(model), job_depth(model)), DeepenedModel)
    me = next(r for r in run(model, config, deep=False, search=False).table if r.configured)
    budgets = Budgets(device=int(me.bytes["device"] * 0.8), host=int(me.bytes["host"] * 0.9), nvme=BIG)
    whole = run(model, config, deep=False, budgets=budgets, search=search)
    assert whole.plans or not search
    assert figures(run(model, config, deep=True, budgets=budgets, search=search)) == figures(whole)


@pytest.mark.parametrize("kv_heads", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_estimators_llama_equals_transformers(kv_heads, tmp_path, monkeypatch):
    """Note [estimator's Llama]: every figure of the estimate (units, every row of the table, the trace with its
    per-unit saves and inputs and FLOPs, the state, the peak), with and without grouped-query attention, tiled and
    checkpointed, equals the one of transformers' LlamaForCausalLM (the plan search is a function of these), with
    the compute priced by its FLOPs; the operations it runs are within 3% of transformers' (1,973 vs 2,022 here:
    a few views and casts fewer a block), their bytes within 2% (the units' forwards: 5%, Note [compute time])."""
    monkeypatch.setattr(probe, "op_seconds", lambda *a, **k: 0.0)
    model = dataclasses.replace(CASES["llama"].values[0], n_kv_head=kv_heads)
    config = infinity.Config.from_dict({**CASES["llama"].values[1], "nvme": {"paths": [str(tmp_path)]}})
    assert type(job_depth(model, own_llama=True).build(2).model).__module__ == "infinity.models.llama"
    mine, theirs = (run(model, config, deep=True, search=False, own_llama=own) for own in (True, False))
    assert figures(mine, work=False) == figures(theirs, work=False)
    for name, within in (("ops", 0.03), ("unit_forward_ops", 0.05), ("bytes", 0.02), ("unit_forward_bytes", 0.05)):
        assert getattr(mine.trace, name) == pytest.approx(getattr(theirs.trace, name), rel=within), name


def test_cut_replay_equals_the_full_replay():
    rng = random.Random(0)
    for _ in range(60):
        units = [(tuple([rng.choice([1000, 3000, 8192])] * rng.randint(0, 30)
                        + [rng.choice([10, 4000, 9000])] * (rng.random() < 0.5)),
                  tuple(rng.random() < 0.6 for _ in range(5)), rng.random() < 0.3)
                 for _ in range(rng.randint(1, 4))]
        pattern = tuple(u for u in units for _ in range(rng.choice([1, 3, 18])))  # blocks repeat
        for reads, writes in ((1, 4), (0, 1), (2, 3)):
            args = (pattern, 2, (4, 2, 2, 4), reads, writes)
            assert traffic._replay_staging(*args, cut=True) == traffic._replay_staging(*args, cut=False), args


def _pretrained_llama(path, **extra) -> str:
    """A Llama directory as a user has one: config.json only (save_pretrained's), grouped-query attention."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             **extra).save_pretrained(path)
    return str(path)


PRETRAINED = {  # config.json extras, [model.lora]
    "bf16, tied, LoRA all-linear with dropout": ({"dtype": "bfloat16", "tie_word_embeddings": True,
                                                  "rms_norm_eps": 1e-5},
                                                 {"r": 4, "alpha": 8.0, "dropout": 0.1, "targets": ("all-linear",)}),
    "fp32, PEFT's default targets": pytest.param({}, {"r": 2, "targets": ("q_proj", "v_proj")},
                                                 marks=pytest.mark.slow),
    "fp16, no LoRA": pytest.param({"dtype": "float16"}, {}, marks=pytest.mark.slow),
}


@pytest.mark.parametrize("extra, lora", PRETRAINED.values(), ids=PRETRAINED)
def test_a_pretrained_llama_directory_estimates_as_transformers_and_peft(extra, lora, tmp_path, monkeypatch):
    """Note [estimator's Llama]: a pretrained Llama directory (and its LoRA wrap) estimated with the copy built
    from its config.json gives every figure of transformers' model wrapped by PEFT (trainable parameters and
    their groups, units, the trace's saves and FLOPs, the table and the plans with the compute priced by its
    FLOPs); its operations and their bytes are near PEFT's (Note [compute time])."""
    from infinity.config.job import LoraConfig
    monkeypatch.setattr(probe, "op_seconds", lambda *a, **k: 0.0)
    model = ModelConfig(pretrained=_pretrained_llama(tmp_path / "llama", **extra), tokenizer="bytes", seq_len=16)
    lora_cfg = LoraConfig(**lora)
    config = infinity.Config.from_dict({**CASES["llama"].values[1], "nvme": {"paths": [str(tmp_path)]}})
    fast, slow = job_depth(model, lora_cfg, own_llama=True), job_depth(model, lora_cfg)
    assert type(fast.build(2).model).__module__ == "infinity.models.llama"

    def run_with(depth, budgets=None, search=True):
        return est.estimate(lambda: build_model(model, lora_cfg), config, batch_size=2, seq_len=16, rates=RATES,
                            cuda=False, budgets=budgets, apply=default_apply(config, 1, 2) if search else None,
                            depth=depth)
    me = next(r for r in run_with(fast, search=False).table if r.configured)  # (budgets: only an input)
    budgets = Budgets(device=int(me.bytes["device"] * 0.8), host=int(me.bytes["host"] * 0.9), nvme=BIG)
    theirs, mine = run_with(slow, budgets), run_with(fast, budgets)
    whole = figures(theirs, work=False)
    assert whole["plans"] or lora.get("r") == 2  # (a rank-2 LoRA of the q/v projections: no plan fits these)
    assert figures(mine, work=False) == whole
    for name, within in (("ops", 0.03), ("unit_forward_ops", 0.05), ("bytes", 0.02), ("unit_forward_bytes", 0.05)):
        assert getattr(mine.trace, name) == pytest.approx(getattr(theirs.trace, name), rel=within), name


def test_the_copy_refuses_a_llama_it_does_not_model():
    """A config.json the copy does not model (or LoRA targets it does not resolve) is left to transformers/PEFT."""
    from infinity.models.llama import llama_fields, lora_targets
    hf = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32, "num_hidden_layers": 6,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}
    assert llama_fields(hf)["kv_heads"] == 2
    for bad in ({"attention_bias": True}, {"mlp_bias": True}, {"hidden_act": "gelu"}, {"attention_dropout": 0.1},
                {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, {"rope_parameters": {"rope_type": "yarn"}},
                {"quantization_config": {"quant_method": "bitsandbytes"}}, {"head_dim": 16}, {"dtype": "float8"},
                {"model_type": "mistral"}, {"pretraining_tp": 2}):
        assert llama_fields({**hf, **bad}) is None, bad
    assert lora_targets(()) == ("q_proj", "v_proj") and lora_targets(("all-linear",))[-1] == "down_proj"
    assert lora_targets(("q_proj", "lm_head")) is None and lora_targets(("self_attn.q_proj",)) is None


def _llama_dir(path, **extra) -> str:
    """A pretrained Llama directory's config.json, written as save_pretrained writes its keys."""
    import json
    path.mkdir()
    hf = {"model_type": "llama", "vocab_size": 320, "hidden_size": 48, "num_hidden_layers": 5,
          "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 40, "max_position_embeddings": 64,
          **extra}
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


TWINS = {  # config.json extras, [model.lora]
    "fp32, grouped-query attention": ({}, {}),
    "bf16, tied, LoRA all-linear with dropout": ({"dtype": "bfloat16", "tie_word_embeddings": True},
                                                 {"r": 4, "alpha": 8.0, "dropout": 0.1, "targets": ("all-linear",)}),
    "fp16, one key/value head per query head, LoRA q/v": ({"dtype": "float16", "num_key_value_heads": 6},
                                                          {"r": 2, "targets": ("q_proj", "v_proj")}),
}


@pytest.mark.parametrize("extra, lora", TWINS.values(), ids=TWINS)
def test_the_small_twin_traces_as_the_meta_trace(extra, lora, tmp_path):
    """Note [small twin]: the Llama copy traced as its small twin (primes for its sizes, counts mapped back) gives
    the meta trace of the model at its own sizes, field by field: saved bytes, the largest, FLOPs, per-unit saves,
    inputs and forward FLOPs; at micro-batch 1 (a size of 1 stays 1) and 3, each of 2 and 3 blocks."""
    from infinity.config.job import LoraConfig
    from infinity.plan.traced import TwinTrace, tracer
    model = ModelConfig(pretrained=_llama_dir(tmp_path / "llama", **extra), tokenizer="bytes", seq_len=10)
    depth = job_depth(model, LoraConfig(**lora), own_llama=True)
    config = infinity.Config.from_dict({"activation": {"checkpoint": "units"}})
    assert depth.sizes is not None
    for blocks in (2, 3):
        twin = TwinTrace(depth.twin(blocks), config, model.seq_len)
        meta = tracer(lambda: depth.build(blocks), config, model.seq_len)  # no twin: on meta tensors
        for batch in (1, 3):
            assert twin(batch) == meta(batch), (blocks, batch)


def test_twin_scale_maps_products_of_sizes_and_refuses_other_counts():
    from infinity.plan.traced import TwinMismatch, twin_scale
    small, scale = twin_scale({"heads": 8, "one": 1, "seq": 4096, "vocab": 32000})
    assert small == {"heads": 3, "one": 1, "seq": 5, "vocab": 7}
    assert scale(2 * 3 * 5 * 5 * 7) == 2 * 8 * 4096 * 4096 * 32000 and scale(1) == 1 and scale(0) == 0
    for other in (11, 3 * 13, 2 * 3 * 5 * 9 + 1):
        with pytest.raises(TwinMismatch):
            scale(other)


def test_a_70b_estimate_never_imports_torch_dynamo(tmp_path):
    """Note [flop count without dynamo], Note [small twin]: a Llama estimate runs no meta kernel of torch's Python
    (whose first call imports torch._dynamo, ~1.1 s) and no FlopCounterMode (the same): its whole estimate, a
    deep [model] Llama (80 blocks of a 70B's width), in a fresh process."""
    import subprocess
    import sys
    code = ("import sys\nfrom infinity.job.cli import main\n"
            "try:\n    main(['estimate', '--model', 'llama', '--set', 'model.n_layer=80',"
            " '--set', 'model.d_model=8192', '--set', 'model.n_head=64', '--set', 'model.n_kv_head=8',"
            " '--set', 'model.ffn_dim=28672',"
            f" '--set', 'nvme.paths=[\"{tmp_path}\"]'])\n"
            "except SystemExit:\n    pass\n"
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo', 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "model: 68456.55M parameters in 81 units" in out.stdout, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "no dynamo False", out.stdout[-2000:] + out.stderr[-2000:]


def test_the_builtin_gpts_small_twin_traces_as_the_meta_trace():
    """Note [small twin]: the built-in GPT (the default job's model), its qkv 3 d wide (3: a constant of the
    model, not a size), traced as its twin equals its meta trace, checkpointed or not, micro-batch 1 and 3."""
    from infinity.plan.traced import TwinTrace, tracer
    model = ModelConfig(kind="gpt", n_layer=5, d_model=48, n_head=4, seq_len=10, vocab_size=300)
    depth = job_depth(model, own_llama=True)
    assert depth.sizes is not None and depth.constants == (2, 3)
    for checkpoint in ("none", "units"):
        config = infinity.Config.from_dict({"activation": {"checkpoint": checkpoint}})
        for blocks in (2, 3):
            twin = TwinTrace(depth.twin(blocks), config, model.seq_len)
            meta = tracer(lambda: depth.build(blocks), config, model.seq_len)
            for batch in (1, 3):
                assert twin(batch) == meta(batch), (checkpoint, blocks, batch)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_the_flop_count_is_torchs_flop_counter(kind):
    """Note [flop count without dynamo]: the estimator's FLOP count, the same trace, equals torch's FlopCounterMode
    (its formulas, its decompositions): the built-in GPT and the estimator's Llama (grouped-query attention)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from infinity.plan.traced import FlopCount
    model = ModelConfig(kind=kind, n_layer=2, d_model=48, n_head=4, n_kv_head=2 if kind == "llama" else 0,
                        seq_len=10, vocab_size=300)
    bundle = job_depth(model, own_llama=True).build(2)
    x = torch.zeros(3, model.seq_len, dtype=torch.long, device="meta")
    net = bundle.model.to("meta")
    counts = []
    for counter in (FlopCount(), FlopCounterMode(display=False)):
        with counter:
            bundle.loss(net, x, x).backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_host_time_is_the_probes_per_unit_time_times_the_units(monkeypatch):
    """Note [host time]: the probe's steady step less its model's plain forward + backward (and step 1's extra) per
    unit, times the model's units (a formula). Planted: unscaled (the probe's time for any model), this fails; the
    plain forward + backward not taken off (Note [compute time] prices the model's operations), this fails."""
    measured = {"rss": 1, "units": 4, "step_s": 0.010, "first_step_s": 0.050, "plain_s": 0.004, "op_s": 1e-5}
    monkeypatch.setattr(probe, "runtime_probe", lambda remeasure=False, modules=(), compiled=None: measured)
    steady, first = HOST_TIME(12)
    assert steady == pytest.approx(0.018) and first == pytest.approx(0.120)
    assert probe.op_seconds() == 1e-5


@pytest.mark.slow
def test_the_runtime_probe_of_a_compiled_run_compiles(tmp_path, monkeypatch):
    """Note [compiled units] in the estimate: a run with `[compile] units = true` imports torch._dynamo and its
    backend and compiles; the probe for it does too, so its RSS holds them (inductor: ~190 MiB on a CPU; the
    estimate was 1.75x under a compiled run's peak without it). Planted: the --compile flag not passed -> the two
    probes measure the same process, the test fails."""
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path))
    eager, compiled = probe.runtime_probe(), probe.runtime_probe(compiled="inductor")
    assert compiled["rss"] > eager["rss"] + (64 << 20), (eager, compiled)
