"""Memory-centric tiling (Note [tiles are units] in infinity/units/tiling.py): a model whose largest layer
exceeds the device budget trains as tiles, at parity with plain torch AdamW on the untiled model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
from adam_tolerance import adam_drift, assert_close_after_adam
from infinity.state.checkpoint import CheckpointError
from infinity.units.tiling import TiledEmbedding, TiledLinear, tile_layers

VOCAB, D, HIDDEN = 64, 16, 2048
TILE = 16 * 1024  # bytes: the up projection (16 x 2048 + 2048 fp32 = 136 KiB) runs as 9 tiles, the down as 16
WIDE_BYTES = (D * HIDDEN + HIDDEN) * 4
LR = 3e-3


class Mlp(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, hidden)
        self.down = nn.Linear(hidden, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Wide(nn.Module):
    """Embedding, a block with a layer wider than the device budget, a narrow block, an untied head."""

    def __init__(self, emb: nn.Embedding | None = None, hidden: int = HIDDEN):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D) if emb is None else emb
        self.blocks = nn.ModuleList([Mlp(hidden), Mlp(32)])
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))


def build() -> Wide:
    torch.manual_seed(0)
    return Wide()


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (4, 9), generator=g) for _ in range(n)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in ids]


def config(tmp_path, tile_bytes: int, device_budget: str | None = "96KiB", params: str = "nvme") -> dict:
    cfg = {"optimizer": {"lr": LR, "weight_decay": 0.1, "grad_clip": 0.0},
           "precision": {"compute_dtype": "fp32"},
           "placement": {"params": params, "grads": "host", "optimizer": "host"},
           "units": {"tile_bytes": tile_bytes}, "nvme": {"paths": [str(tmp_path)]},
           "prefetch": {"units_ahead": 1}}
    if device_budget is not None:
        cfg["memory"] = {"device_budget": device_budget, "host_budget": "64MiB"}
    return cfg


def loss_of(model, batch):
    return model(*batch)


def test_tiled_linear_equals_the_linear_bitwise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 1000))
    x = torch.randn(3, 5, 16)
    expected = model(x)
    tiling = tile_layers(model, 4096, 4)
    assert isinstance(model[0], TiledLinear) and len(model[0].tiles) == 17  # 17 x 59 rows of 68 bytes <= 4 KiB
    assert all(sum(p.numel() for p in t.parameters()) * 4 <= 4096 for t in model[0].tiles)
    assert torch.equal(model(x), expected)
    assert list(tiling.untile({k: v for k, v in model.state_dict().items()})) == ["0.weight", "0.bias"]


def groups_of(model: nn.Module) -> list[dict]:
    """Two parameter groups of `model`'s own parameters: no decay on biases and norms (named by the untiled
    model: the engine resolves them before tiling)."""
    flat = [p for n, p in model.named_parameters() if n.endswith("bias") or ".norm." in n]
    return [{"params": [p for p in model.parameters() if all(p is not q for q in flat)], "weight_decay": 0.1},
            {"params": flat, "weight_decay": 0.0}]


def reference(model: nn.Module, data, lr: float = LR, dtype: torch.dtype = torch.float32) -> tuple[list[float], dict]:
    """Plain torch AdamW on the untiled model, with `groups_of` its parameter groups (in `dtype`; the state dict
    returned in float32)."""
    model = copy.deepcopy(model).to(dtype)
    opt = torch.optim.AdamW(groups_of(model), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for batch in data:
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.float() for k, v in model.state_dict().items()}


def train(engine, data) -> list[float]:
    losses = []
    for batch in data:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_a_tile_smaller_than_a_row_is_refused_naming_the_least_size():
    with pytest.raises(infinity.ConfigError, match=r"tile_bytes = 50 is less than one row of 0 .*at least 68"):
        tile_layers(nn.Sequential(nn.Linear(16, 1000)), 50, 4)


@pytest.mark.parametrize("params", ["nvme", "host"])
def test_a_layer_larger_than_the_device_budget_trains_at_parity(tmp_path, params, on_device=False):
    """On the CPU at fp32 tolerances; `on_device` (the GPU twin): the engine's maths on the GPU, the reference's
    on the CPU, the parameters within the Adam tolerance (adam_tolerance.py)."""
    model, data = build(), batches(4)
    ref_losses, ref_state = reference(model, data)
    # Untiled, the wide layer's unit does not fit the device budget: the planner says so.
    with pytest.raises(infinity.PlacementError, match="device_budget"):
        infinity.initialize(copy.deepcopy(model), config(tmp_path, 0, params=params))
    tiled = copy.deepcopy(model)
    engine = infinity.initialize(tiled, config(tmp_path, TILE, params=params), param_groups=groups_of(tiled))
    try:
        losses = train(engine, data)
        names = [u.name for u in engine.units]  # the wide block split into its children, each tile a unit
        assert names == (["<root>", "blocks.0.norm"] + [f"blocks.0.up.tiles.{i}" for i in range(9)]
                         + [f"blocks.0.down.tiles.{i}" for i in range(16)] + ["blocks.1"])
        # Each unit's device working memory is bounded by a tile, not by the wide layer.
        assert max(u.peak_unsharded for u in engine.units[1:]) <= TILE < WIDE_BYTES
        state = engine.full_state_dict()
    finally:
        engine.close()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert list(state) == list(ref_state)  # the untiled names, in the untiled order
    if on_device:
        assert_close_after_adam(state, ref_state, steps=len(data), lr=LR)
        return
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_the_adam_tolerance_passes_other_rounding_and_catches_real_bugs():
    """adam_tolerance.py's bounds, calibrated on the tiling model's reference (4 steps at lr 3e-3): a float64
    run (other rounding, as a GPU's) passes far under them; a learning rate 10% off, a skipped step and one
    tile of nine not updated fail."""
    model, data = build(), batches(4)
    _, want = reference(model, data)
    _, other_rounding = reference(model, data, dtype=torch.float64)
    assert max(adam_drift(other_rounding[k], want[k])[0] for k in want) < LR / 1000  # (5e-8 here)
    assert_close_after_adam(other_rounding, want, steps=len(data), lr=LR)
    rows, up = HIDDEN // 9, "blocks.0.up.weight"  # one tile's rows of the up projection, at their initial values
    untouched = want | {up: torch.cat([model.blocks[0].up.weight.detach()[:rows], want[up][rows:]])}
    for bug in (reference(model, data, lr=LR * 1.1)[1], reference(model, data[:3])[1], untouched):
        with pytest.raises(AssertionError, match=r"mean \|a - b\| = .* after 4 Adam steps"):
            assert_close_after_adam(bug, want, steps=len(data), lr=LR)


BIG_VOCAB = 2048  # the input table: 2048 x 16 fp32 = 128 KiB, over the 96 KiB device budget


def big_vocab() -> Wide:
    """An input embedding (with a padding row) larger than the device budget, narrow blocks and a small head (64
    classes): the embedding is the one tiled layer (a tiled Linear's input gradient sums its tiles': not bitwise)."""
    return Wide(nn.Embedding(BIG_VOCAB, D, padding_idx=3), hidden=32)


def test_tiled_embedding_equals_the_embedding_bitwise():
    """Each output row is the untiled lookup, the table's gradient the untiled one (the padding row's zero)."""
    torch.manual_seed(0)
    model, ids = nn.Sequential(nn.Embedding(1000, 16, padding_idx=437)), torch.randint(0, 1000, (4, 33))
    ids[0, :5] = 437
    untiled = copy.deepcopy(model)
    tiling = tile_layers(model, 4096, 4)
    assert isinstance(model[0], TiledEmbedding) and len(model[0].tiles) == 16  # 16 x 63 rows of 64 bytes <= 4 KiB
    assert [t.padding_idx for t in model[0].tiles].count(437 - 6 * 63) == 1
    out, expected = model(ids), untiled(ids)
    assert torch.equal(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    grads = tiling.untile({f"0.tiles.{i}.weight": t.weight.grad for i, t in enumerate(model[0].tiles)})
    assert torch.equal(grads["0.weight"], untiled[0].weight.grad) and not grads["0.weight"][437].any()


def test_an_embedding_larger_than_the_device_budget_trains_at_parity(tmp_path):
    torch.manual_seed(0)
    model = big_vocab()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, BIG_VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g))
            for _ in range(4)]
    data[0][0][0, :3] = 3  # the padding row
    ref_losses, ref_state = reference(model, data)
    tiled = copy.deepcopy(model)
    engine = infinity.initialize(tiled, config(tmp_path, TILE), param_groups=groups_of(tiled))
    try:
        losses = train(engine, data)
        names = [u.name for u in engine.units]
        assert names == ["<root>"] + [f"emb.tiles.{i}" for i in range(8)] + ["blocks.0", "blocks.1"]
        assert max(u.peak_unsharded for u in engine.units[1:]) <= TILE < BIG_VOCAB * D * 4
        state = engine.full_state_dict()
    finally:
        engine.close()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)  # (the lookup and its gradient are exact)
    assert list(state) == list(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_layer_called_head_is_tiled_unless_a_chunked_loss_reads_it(tmp_path):
    """Only a chunked loss's head is kept whole: a model's own attribute called `head` is no exception (it was:
    the engine asked the forward for a `head` attribute, and the forward without a chunked loss is the model)."""
    engine = infinity.initialize(big_vocab(), config(tmp_path, 2048, device_budget=None))
    try:
        assert "head.tiles.1" in [u.name for u in engine.units]
    finally:
        engine.close()


class LiveUnsharded:
    """The most unsharded bytes alive at once (wraps the engine's UnshardedMemory)."""

    def __init__(self, engine):
        self.live, self.peak, memory = {}, 0, engine.unsharded
        grow, shrink = memory.grow, memory.shrink

        def grown(key, storage, nbytes):
            grow(key, storage, nbytes)
            self.live[key] = nbytes
            self.peak = max(self.peak, sum(self.live.values()))

        def shrunk(key, storage):
            shrink(key, storage)
            self.live.pop(key, None)
        memory.grow, memory.shrink = grown, shrunk


@pytest.mark.parametrize("offload", ["none", "host"])
def test_a_tiled_block_checkpointed_whole_recomputes_one_tile_at_a_time(tmp_path, offload):
    model, data = build(), batches(3)
    ref_losses, ref_state = reference(model, data)
    saved = {}
    for checkpoint in ("none", "units"):
        tiled = copy.deepcopy(model)
        cfg = config(tmp_path, TILE, params="nvme") | {"activation": {"checkpoint": checkpoint, "offload": offload
                                                                      if checkpoint == "units" else "none"}}
        engine = infinity.initialize(tiled, cfg, param_groups=groups_of(tiled))
        live = LiveUnsharded(engine)
        try:
            losses = train(engine, data)
            saved[checkpoint] = engine.memory_report()["activation_saved_bytes"]
            state = engine.full_state_dict()
        finally:
            engine.close()
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
        # the root (8 KiB), the unit computing, one prefetched and one the recomputation holds: never the block
        assert live.peak <= 8 * 1024 + 3 * TILE < WIDE_BYTES, (checkpoint, live.peak)
    # the wide block whole: only its input is kept, not what runs between its tiles (the GELU's input, ...)
    rows, hidden_bytes = 4 * 8, HIDDEN * 4
    assert saved["none"] - saved["units"] >= rows * hidden_bytes, saved


def test_the_disk_reads_of_a_recomputed_tiled_block_are_the_plans(tmp_path):
    """Each tile is read three times per micro-batch (forward, recomputation, backward): the byte model says so."""
    from infinity.memory.traffic import bytes_per_step
    from infinity.profile import Link, SpanKind
    cfg = config(tmp_path, TILE, device_budget=None) | {"activation": {"checkpoint": "units"},
                                                        "profile": {"enabled": True, "trace_dir": str(tmp_path / "t")}}
    engine = infinity.initialize(build(), cfg)
    engine.profiler.clear()  # initialization's writes are not a step's
    data = batches(3)
    train(engine, data)
    engine.close()
    read = sum(s.num_bytes for s in engine.profiler.spans() if s.kind is SpanKind.WORK and s.link is Link.NVME_READ)
    predicted = sum(bytes_per_step(engine.plan, grad_accum_steps=1, first_step=step == 0, cuda=False,
                                   kept=engine.kept_params)["nvme_read"] for step in range(len(data)))
    assert read == predicted > 0
    tile = next(s for s in engine.plan.units if ".tiles." in s.name)
    assert tile.fetches == 3


def test_checkpoints_exports_and_weights_speak_the_untiled_names(tmp_path):
    data = batches(3)
    cfg = config(tmp_path, TILE, device_budget=None, params="host")
    with infinity.initialize(build(), cfg) as engine:
        train(engine, data[:2])
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        engine.export_state_dict(str(tmp_path / "export.safetensors"))
        state = engine.full_state_dict()
        after = train(engine, data[2:])
    from safetensors.torch import load_file
    exported = load_file(str(tmp_path / "export.safetensors"))
    assert sorted(exported) == sorted(build().state_dict())
    for key in state:
        assert torch.equal(exported[key], state[key]), key
    # weights= from the export: the same values, untiled or tiled
    for tile_bytes in (0, TILE):
        with infinity.initialize(build(), config(tmp_path, tile_bytes, device_budget=None, params="host"),
                                 weights=str(tmp_path / "export.safetensors")) as engine:
            loaded = engine.full_state_dict()
        assert all(torch.equal(loaded[k], state[k]) for k in state), tile_bytes
    # a checkpoint resumes with its tiling, and refuses another
    with infinity.initialize(build(), cfg) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert train(engine, data[2:]) == after
    with infinity.initialize(build(), config(tmp_path, 0, device_budget=None, params="host")) as engine:
        with pytest.raises(CheckpointError, match=r"tile_bytes = 16384 .*Resume with tile_bytes = 16384"):
            engine.load_checkpoint(str(tmp_path / "ckpt"))


def test_the_estimate_plans_the_tiles():
    from infinity.memory.placement import plan_for_config
    from infinity.memory.plan import Budgets
    from infinity.memory.tier import Kind, Tier
    from infinity.plan.estimate import unit_sizes_of
    budgets = Budgets(device=2**30, host=2**30, nvme=2**30)
    device = {}
    for tile_bytes in (0, TILE):
        settings = config("/tmp", tile_bytes, device_budget=None)
        settings.setdefault("placement", {})["tail_units"] = 0  # (a GPU's budgets: no unit's state moves to it)
        cfg = infinity.Config.from_dict(settings)
        sizes = unit_sizes_of(build(), cfg, world_size=1)
        largest = max(s.numel(Kind.PARAMS) * 4 for s in sizes[1:])
        assert (largest <= TILE) == (tile_bytes > 0), (tile_bytes, largest)
        device[tile_bytes] = plan_for_config(sizes, cfg, budgets).tier_totals()[Tier.DEVICE]
    # the device working set (root + 2 units gathered + a unit's fp32 gradient and shard) is the engine's
    assert device[TILE] <= 96 * 1024 < WIDE_BYTES < device[0]


def tiled_on_rank(rank: int, world: int, stage: int, swap: str):
    """One rank of a tiled run (params on NVMe) on its rows of each batch; the rank-mean losses and the state."""
    import os

    import torch.distributed as dist
    os.makedirs(f"{swap}/r{rank}", exist_ok=True)
    model = build()
    cfg = config(f"{swap}/r{rank}", TILE, device_budget=None) | {"zero": {"stage": stage}}
    engine = infinity.initialize(model, cfg, param_groups=groups_of(model))
    losses = []
    for x, y in batches(4):
        rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean / world).item())
    state = engine.full_state_dict()
    engine.close()
    return losses, state


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 1])
def test_tiles_at_world_2_match_torch_adamw(tmp_path, stage):
    from dist_utils import run_distributed
    ref_losses, ref_state = reference(build(), batches(4))
    losses, state = run_distributed(tiled_on_rank, 2, stage, str(tmp_path))[0]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_hugging_face_llama_tiled_gives_transformers_logits_and_generation(tmp_path):
    """Its untied input embedding and projections tiled (Note [tiles are units]): the logits are transformers' own,
    and greedy generation (which reads the input embeddings through the model) gives the same tokens."""
    import hf_tiny  # (tests/helpers; imports transformers)
    reference = hf_tiny.reference("llama")
    engine = infinity.initialize(copy.deepcopy(reference), {**hf_tiny.HOST, "units": {"tile_bytes": 8192}})
    try:
        names = [u.name for u in engine.units]
        assert "model.embed_tokens.tiles.2" in names and "model.layers.0.self_attn.q_proj.tiles.1" in names
        x = hf_tiny.prompt()
        with torch.no_grad():
            assert torch.equal(engine(x).logits, reference(x).logits)
        greedy = {"max_new_tokens": 3, "do_sample": False}
        assert torch.equal(engine.generate(x[:, :4], **greedy), reference.generate(x[:, :4], **greedy))
    finally:
        engine.close()


@pytest.mark.gpu
def test_gpu_a_layer_larger_than_the_device_budget_trains_at_parity(tmp_path):
    """The GPU twin (issue 42): tiles fetched to HBM one at a time, against the same torch reference."""
    test_a_layer_larger_than_the_device_budget_trains_at_parity(tmp_path, "nvme", on_device=True)
