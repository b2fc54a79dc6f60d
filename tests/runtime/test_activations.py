"""[activation]: unit checkpoints and host offload train exactly like plain PyTorch, keep fewer bytes, and
never fetch a parameter on demand once the order is known (Note [unit checkpoints], Note [activation
offload], Note [activation bytes], Note [backward prefetch])."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import infinity
from dist_utils import run_distributed
from engine_runs import engine_run, train_steps
from infinity.config.sections import ConfigError
from infinity.models.gpt import GPT
from reference import TINY, Recipe, engine_losses, plain_adamw, reference_run

RECIPE = Recipe(steps=4, accum=1)
PLACED = {"host": {"params": "host", "grads": "host", "optimizer": "host"},
          "nvme": {"params": "nvme", "grads": "host", "optimizer": "nvme"}}


def activation(checkpoint="none", offload="none", overlap=True) -> dict:
    return {"activation": {"checkpoint": checkpoint, "offload": offload},
            "overlap": {"optimizer_with_backward": overlap}}


def assert_same_run(run, ref):
    (losses, _, state, _), (ref_losses, _, ref_state) = run, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert set(state) == set(ref_state)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], msg=key)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("section, message", [
    ({"checkpoint": "layers"}, 'valid: "none" | "units"'),
    ({"offload": "nvme"}, 'valid: "none" | "host"'),
    ({"offload": "host"}, 'set activation.checkpoint = "units"'),
    ({"checkpoints": "units"}, "did you mean"),
])
def test_bad_activation_config_says_what_to_change(section, message):
    with pytest.raises(ConfigError, match=message):
        infinity.Config.from_dict({"activation": section})


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("tier, checkpoint_, offload, overlap", [
    ("host", "units", "none", False),
    ("host", "units", "host", True),
    ("nvme", "units", "host", False),
    ("nvme", "units", "none", True),
])
def test_checkpointed_units_train_like_plain_pytorch(tier, checkpoint_, offload, overlap, tmp_path):
    ref = reference_run(RECIPE)
    swap = str(tmp_path) if tier == "nvme" else None
    run = engine_run(RECIPE, PLACED[tier], swap, activation(checkpoint_, offload, overlap))
    assert_same_run(run, ref)
    plain = engine_run(RECIPE, PLACED["host"], None, activation())
    assert run[0] == plain[0]  # the same losses as without checkpoints, bit for bit (the same maths)
    assert run[3]["activation_late_fetches"] == 0  # every offloaded input was fetched one unit ahead


def _two_ranks(rank, world, swap_dir, stage):
    return engine_run(RECIPE, PLACED["nvme"], os.path.join(swap_dir, str(rank)),
                      activation("units", "host") | {"zero": {"stage": stage}}, rank=rank, world=world)


@pytest.mark.parametrize("stage", [3, pytest.param(1, marks=pytest.mark.slow)])
def test_checkpointed_units_at_world_size_2_train_like_plain_pytorch(stage, tmp_path):
    runs = run_distributed(_two_ranks, 2, str(tmp_path), stage)
    assert_same_run(runs[0], reference_run(RECIPE))
    assert runs[0][3]["activation_late_fetches"] == 0


def test_hf_llama_with_checkpointed_offloaded_units_trains_like_plain_pytorch(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        use_cache=False))
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 96, (4, 17), generator=g) for _ in range(3)]

    def loss_of(forward, b):
        return F.cross_entropy(forward(input_ids=b[:, :-1]).logits.float().reshape(-1, 96), b[:, 1:].reshape(-1))

    ref_losses, ref_state = plain_adamw(model, data, loss_of, lr=3e-3, weight_decay=0.1)
    optimizer = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 0.0}
    cfg = {"optimizer": optimizer, "placement": PLACED["nvme"], "nvme": {"paths": [str(tmp_path)]},
           **activation("units", "host")}
    with infinity.initialize(model, cfg) as engine:
        losses = engine_losses(engine, data, loss_of)
        state = engine.full_state_dict()
        report = engine.memory_report()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=key)
    hidden = 4 * 16 * 32 * 4  # batch x seq x hidden_size x fp32: each decoder layer's saved input
    assert report["activation_host_bytes"] == 2 * hidden


# ---------------------------------------------------------------- bytes


def _saved(checkpoint_, offload, tier="host"):
    cfg = RECIPE.config(**PLACED[tier]) | activation(checkpoint_, offload)
    with infinity.initialize(RECIPE.build(), cfg) as engine:
        x, y = RECIPE.batches()[0][0]
        engine.backward(engine(x, y))
        return engine.memory_report(), dict(engine.activations.meter.per_unit)


def test_saved_activation_bytes_follow_the_formula():
    none, per_unit = _saved("none", "none")
    units, _ = _saved("units", "none")
    host, _ = _saved("units", "host")
    blocks = sum(v for k, v in per_unit.items() if k != 0)  # what the blocks' own forwards save
    root = per_unit[0]  # embeddings, final norm, head and loss: never checkpointed
    boundary = TINY.n_layer * RECIPE.micro_batch * TINY.seq_len * TINY.d_model * 4  # each block's fp32 input
    assert none["activation_saved_bytes"] == root + blocks
    assert units["activation_saved_bytes"] == root + boundary
    assert (host["activation_saved_bytes"], host["activation_host_bytes"]) == (root, boundary)
    assert units["activation_saved_bytes"] < none["activation_saved_bytes"] / 3


# ---------------------------------------------------------------- prefetch


class SelfCheckpointingGPT(GPT):
    """A model that checkpoints its own blocks (as Hugging Face's gradient checkpointing does): its
    recomputation fires the blocks' module hooks inside backward (Note [recomputed forward])."""

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@pytest.mark.parametrize("model, checkpoint_, waits, overlap", [
    ("gpt", "units", 2, False), ("gpt", "units", 2, True), ("self-checkpointing", "none", 3, False)])
def test_recomputation_keeps_the_forward_order_and_nothing_is_fetched_on_demand(model, checkpoint_, waits, overlap,
                                                                                 tmp_path):
    """Every step's forward order is the blocks' (a recomputation records none), and from step 2 on every
    unshard of a block was prefetched, forward and backward, recomputation included. `waits`: a block's
    unshard is waited for per step in its forward, its pre-backward and, when the model checkpoints its own
    blocks, again in its recomputation's pre-hook (Note [recomputed forward]). With the overlapped optimizer
    and clipping the update of a block runs in the next forward, so its fetch follows the update
    (`after_update`), which is not on demand (Note [backward prefetch])."""
    cls = SelfCheckpointingGPT if model == "self-checkpointing" else GPT
    torch.manual_seed(0)
    offload = "host" if checkpoint_ == "units" else "none"
    cfg = RECIPE.config(**PLACED["nvme"]) | activation(checkpoint_, offload, overlap)
    cfg |= {"nvme": {"paths": [str(tmp_path)]}, "profile": {"enabled": True, "trace_dir": str(tmp_path / "trace")}}
    blocks = list(range(1, TINY.n_layer + 1))
    with infinity.initialize(cls(TINY), cfg) as engine:
        on_demand = []
        for step in range(RECIPE.steps):
            before = engine.prefetcher.on_demand
            train_steps(engine, RECIPE, step, step + 1, 0, 1)
            on_demand.append(engine.prefetcher.on_demand - before)
            assert engine.prefetcher.trace.recorded == blocks, step
        summary = engine.profiler.summary()
        prefetched = engine.prefetcher.hits + engine.prefetcher.after_update
        late = engine.memory_report()["activation_late_fetches"]
    assert on_demand[0] == TINY.n_layer  # step 1 records the forward order; its backward is already prefetched
    assert on_demand[1:] == [0] * (RECIPE.steps - 1)
    assert prefetched == RECIPE.steps * waits * TINY.n_layer - TINY.n_layer
    if not overlap:
        assert engine.prefetcher.after_update == 0
    marked = [s["on_demand_fetches"] for s in summary["steps"]]  # the profile shows the same (its steps: the clock's)
    assert marked[0] == TINY.n_layer and sum(marked) == TINY.n_layer, marked
    assert late == 0  # offloaded inputs: every copy back was issued one unit ahead


def test_estimate_predicts_the_saved_bytes_the_engine_measures():
    """`infinity estimate`'s activation terms (Note [activation estimate]) against the engine's own count. The
    meta trace picks another attention kernel than the CPU run (it saves the attention probabilities, 15 KiB
    more per block here), so the totals agree to 15%; the inputs and the offloaded bytes exactly."""
    from infinity.config.sections import ActivationConfig
    from infinity.memory.cost_model import Work
    from infinity.plan import estimate as est
    model = GPT(TINY)
    trace = est.trace_step(model, lambda m, x, y: m(x, y), RECIPE.micro_batch, TINY.seq_len, list(model.blocks))
    none, _ = _saved("none", "none")
    units, _ = _saved("units", "none")
    host, _ = _saved("units", "host")
    terms = {(c, o): est.activation_terms(trace, ActivationConfig(checkpoint=c, offload=o))
             for c, o in (("none", "none"), ("units", "none"), ("units", "host"))}
    block_input = RECIPE.micro_batch * TINY.seq_len * TINY.d_model * 4
    root = trace.activation_bytes - sum(trace.unit_saved)
    assert trace.unit_inputs == (block_input,) * TINY.n_layer
    assert terms["none", "none"] == {"saved": trace.activation_bytes, "recompute": 0, "host": 0}
    assert terms["units", "none"] == {"saved": root + TINY.n_layer * block_input,
                                      "recompute": max(trace.unit_saved), "host": 0}
    assert terms["units", "host"] == {"saved": root + 2 * block_input, "recompute": max(trace.unit_saved),
                                      "host": host["activation_host_bytes"]}
    assert terms["none", "none"]["saved"] == pytest.approx(none["activation_saved_bytes"], rel=0.15)
    assert terms["units", "none"]["saved"] == pytest.approx(units["activation_saved_bytes"], rel=0.15)
    # the recompute: one more forward of the blocks (not of the root's embedding, head and loss)
    assert 0 < trace.unit_forward_flops < trace.flops / 3
    whole = Work(trace.flops, trace.bytes, trace.ops)
    blocks = Work(trace.unit_forward_flops, trace.unit_forward_bytes, trace.unit_forward_ops)
    assert 0 < blocks.bytes < whole.bytes and 0 < blocks.ops < whole.ops
    assert trace.step_work("units") == whole + blocks and trace.step_work("none") == whole


@pytest.mark.gpu
@pytest.mark.parametrize("offload", ["none", "host"])
def test_gpu_checkpointed_units_train_like_the_cpu_reference(offload, tmp_path):
    """The CUDA path: the offload's d2h / h2d streams and events, pinned host copies (skipped without a GPU)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    (ref_losses, _, ref_state), tier = reference_run(RECIPE), PLACED["nvme"]
    losses, _, state, report = engine_run(RECIPE, tier, str(tmp_path), activation("units", offload))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-4)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-3, atol=1e-4)
    boundary = TINY.n_layer * RECIPE.micro_batch * TINY.seq_len * TINY.d_model * 4
    assert report["activation_host_bytes"] == (boundary if offload == "host" else 0)
    assert report["activation_late_fetches"] == 0
