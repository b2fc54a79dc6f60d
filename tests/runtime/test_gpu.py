"""GPU paths: CUDA streams, pinned host tiers, device tier in HBM, buffers, checkpoints (skipped without a GPU).

Every test feeds CPU tensors, as a user's data loader does: the engine moves its inputs to the device.
The reference runs on the CPU in fp32; TF32 is off so that the GPU's matmuls are fp32 too.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn as nn

import infinity
from engine_runs import ALL_PLACEMENTS, engine_run, train_steps
from reference import Recipe, reference_run

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def exact_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _swap(placement: dict, tmp_path) -> str | None:
    return str(tmp_path) if "nvme" in placement.values() else None


@pytest.mark.parametrize("placement", ALL_PLACEMENTS, ids=lambda p: "-".join(p.values()))
def test_gpu_training_matches_cpu_reference(placement, tmp_path):
    """All 27 placements at fp32, the optimizer on the device included (torch's fused CUDA AdamW)."""
    recipe = Recipe()
    ref_losses, _, ref_state = reference_run(recipe)
    losses, _, state, report = engine_run(recipe, placement, _swap(placement, tmp_path))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-4)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-3, atol=1e-4)
    assert report["cuda_peak_bytes"] > 0


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
def test_gpu_bf16_follows_fp32(tier, overlap, tmp_path):
    """bf16 compute with fp32 masters, parameters and optimizer off the device: follows the fp32 run, loosely
    (tests/runtime/test_bf16_reference.py holds bf16 to a reference doing the same maths, on the GPU when there
    is one)."""
    recipe = Recipe(steps=4)
    ref_losses, _, ref_state = reference_run(recipe)
    placement = {"params": tier, "grads": "host", "optimizer": tier}
    extra = {"precision": {"compute_dtype": "bf16"}, "overlap": {"optimizer_with_backward": overlap}}
    losses, _, state, _ = engine_run(recipe, placement, _swap(placement, tmp_path), extra)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=0.05)
    assert state["wte.weight"].dtype == torch.float32, "masters stay fp32"
    torch.testing.assert_close(state["blocks.0.fc.weight"], ref_state["blocks.0.fc.weight"], rtol=0, atol=5e-3)


class BufferedNet(nn.Module):
    """Buffers of every kind a forward reads: BatchNorm statistics (updated in train mode), a persistent
    scale and a non-persistent mask. (No bias right before a BatchNorm: its gradient would be zero up to
    rounding, and Adam would step along the rounding noise.)"""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.BatchNorm1d(16))
                                     for _ in range(3)])
        self.out = nn.Linear(16, 1)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.register_buffer("mask", (torch.arange(16) % 3 != 0).float(), persistent=False)

    def forward(self, x, y):
        h = self.inp(x) * self.scale * self.mask
        for block in self.blocks:
            h = block(h)
        return nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def test_gpu_buffers_are_on_the_device_and_train_like_torch(tmp_path):
    model = BufferedNet()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 8, generator=g), torch.randn(32, generator=g)) for _ in range(4)]
    ref_losses = []
    for x, y in data:
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    engine = infinity.initialize(model, {"optimizer": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                       "weight_decay": 0.1, "grad_clip": 0.0},
                                         "placement": {"params": "host", "grads": "host", "optimizer": "host"}})
    with engine:
        assert all(b.device == engine.device for b in engine.module.buffers())
        losses = []
        for x, y in data:  # CPU inputs
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.full_state_dict()
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    fresh = infinity.initialize(BufferedNet(), {"optimizer": {"grad_clip": 0.0},
                                                "placement": {"params": "host", "grads": "host", "optimizer": "host"}})
    with fresh:
        fresh.load_checkpoint(str(tmp_path / "ckpt"))  # the saved buffers land in the device-resident ones
        for name, buf in fresh.module.named_buffers():
            assert buf.device == fresh.device, name
            if name != "mask":  # (not persistent: not saved, the model's own)
                assert torch.equal(buf.cpu(), state[name].cpu()), name
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key].cpu(), value, rtol=1e-3, atol=1e-4, msg=key)


@pytest.mark.parametrize("placement", [{"params": "device", "grads": "device", "optimizer": "device"},
                                       {"params": "host", "grads": "host", "optimizer": "nvme"}],
                         ids=["device", "offload"])
def test_gpu_checkpoint_resume_and_export(placement, tmp_path):
    """Save after 2 steps, train 2 more; a new engine loads the checkpoint and trains the same 2 steps
    bitwise; the exported file holds the full state dict."""
    from safetensors.torch import load_file
    recipe = Recipe(steps=4)
    config = recipe.config(**placement) | {"nvme": {"paths": [str(tmp_path / "swap")]}}
    (tmp_path / "swap").mkdir()
    ckpt = str(tmp_path / "ckpt")
    engine = infinity.initialize(recipe.build(), config)
    with engine:
        train_steps(engine, recipe, 0, 2, rank=0, world=1)
        engine.save_checkpoint(ckpt)
        first = train_steps(engine, recipe, 2, 4, rank=0, world=1)
        state = engine.full_state_dict()
        exported = engine.export_state_dict(str(tmp_path / "model.safetensors"))
    engine = infinity.initialize(recipe.build(), config)
    with engine:
        engine.load_checkpoint(ckpt)
        again = train_steps(engine, recipe, 2, 4, rank=0, world=1)
        resumed = engine.full_state_dict()
    assert again == first
    for key in state:
        assert torch.equal(resumed[key], state[key]), key
    on_disk = load_file(exported)
    for key in state:
        assert torch.equal(on_disk[key], state[key]), key


def test_host_tier_is_pinned_with_cuda():
    """Every state on the host tier: tail_units = 0 (by default, "auto" keeps the forward-first units' gradients
    and optimizer state on the GPU: Note [tail units])."""
    from infinity.memory.tier import Kind, Tier
    engine = infinity.initialize(Recipe().build(), {"placement": {"params": "host", "grads": "host",
                                                                   "optimizer": "host", "tail_units": 0}})
    with engine:
        shard = engine.manager._shards[(1, Kind.MASTER)]
        assert shard.tier is Tier.HOST, shard.tier
        assert shard.resident.is_pinned()
        assert engine.streams.is_cuda and engine.streams.h2d is not None


@pytest.mark.parametrize("clip", ["firing", "none"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_device_lane_trains_like_torch_with_the_clip_firing(dtype, clip, monkeypatch):
    """Note [device lane]: the units the lane takes are updated on the GPU (their state copied up and back; in fp32
    the parameters are the master there), the others by the CPU; with the clip firing in some windows (the deferred
    update) or no clipping (the eager update, units offered as backward finalizes them) the run follows torch AdamW
    (after clip_grad_norm_) (fp32 as closely as every placement; bf16 as loosely as bf16 does)."""
    import dataclasses

    from infinity.optim.offloaded import OffloadedOptimizer
    base = Recipe(steps=4, accum=2)
    _, norms, _ = reference_run(dataclasses.replace(base, grad_clip=1e9))
    recipe = dataclasses.replace(base, grad_clip=sorted(norms)[len(norms) // 2] if clip == "firing" else 0.0)
    stepped = {True: 0, False: 0}
    step = OffloadedOptimizer.step

    def counting(self, **kwargs):
        stepped[self.on_device] += len(kwargs.get("units") or [])
        if not self.on_device:
            time.sleep(0.01)  # (a tiny model's CPU Adam could claim every unit before the lane runs once)
        return step(self, **kwargs)
    monkeypatch.setattr(OffloadedOptimizer, "step", counting)
    ref_losses, _, ref_state = reference_run(recipe)
    placement = {"params": "device", "grads": "host", "optimizer": "host", "tail_units": 0}
    extra = {"precision": {"compute_dtype": dtype}, "overlap": {"optimizer_with_backward": True, "device_lane": "on"}}
    losses, _, state, report = engine_run(recipe, placement, None, extra)
    mode = "DeferredUpdate" if clip == "firing" else "EagerUpdate"
    assert report["update_mode"] == mode and stepped[True] > 0, stepped
    exact = dtype == "fp32"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4 if exact else 0,
                               atol=1e-4 if exact else 0.05)
    for key in ref_state if exact else ["blocks.0.fc.weight"]:  # (as test_gpu_bf16_follows_fp32)
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-3 if exact else 0, atol=1e-4 if exact else 5e-3)
