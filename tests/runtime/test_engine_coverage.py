"""Engine behaviours the parity tests leave out, each against plain PyTorch (a broken engine fails here):
clipping that must not clip, Adam with L2 decay, fp16 loss-scale growth and its restore on resume, and
parameters that get a gradient on some ranks only at world size 2."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import infinity
from dist_utils import run_distributed
from engine_runs import engine_run
from reference import Recipe, reference_run

DEVICE = {"params": "device", "grads": "device", "optimizer": "device"}
NVME = {"params": "nvme", "grads": "host", "optimizer": "nvme"}


def assert_same(reference, losses, norms, state, what):
    ref_losses, ref_norms, ref_state = reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=lambda m: f"{what} losses: {m}")
    if ref_norms:
        torch.testing.assert_close(torch.tensor(norms, dtype=torch.float32), torch.tensor(ref_norms),
                                   msg=lambda m: f"{what} norms: {m}")
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], msg=lambda m, k=key: f"{what} {k}: {m}")


@pytest.mark.parametrize("placement", [DEVICE, NVME], ids=["device", "nvme"])
def test_a_gradient_norm_below_grad_clip_is_not_scaled(placement, tmp_path):
    """clip_coef = min(1, grad_clip / norm): with norms below grad_clip the gradients are used as they are."""
    recipe = Recipe(steps=3, grad_clip=50.0)
    reference = reference_run(recipe)
    assert all(n < recipe.grad_clip for n in reference[1]), f"the norms must stay below grad_clip: {reference[1]}"
    losses, norms, state, _ = engine_run(recipe, placement, str(tmp_path / "swap"))
    assert_same(reference, losses, norms, state, f"clip above the norm, {placement}")


@pytest.mark.parametrize("placement", [DEVICE, NVME], ids=["device", "nvme"])
def test_adam_with_l2_decay_matches_torch_adam(placement, tmp_path):
    """optimizer.name = "adam": weight decay added to the gradient (torch.optim.Adam), not decoupled (AdamW)."""
    recipe = Recipe(steps=3, optimizer="adam", weight_decay=0.5)
    reference = reference_run(recipe)
    adamw = reference_run(Recipe(steps=3, optimizer="adamw", weight_decay=0.5))
    assert not torch.equal(reference[2]["blocks.0.fc.weight"], adamw[2]["blocks.0.fc.weight"])
    losses, norms, state, _ = engine_run(recipe, placement, str(tmp_path / "swap"))
    assert_same(reference, losses, norms, state, f"adam {placement}")


# ---------------------------------------------------------------- fp16 loss scale

FP16 = {"compute_dtype": "fp16", "initial_loss_scale": 256.0, "loss_scale_growth_interval": 2}


def _fp16_engine(recipe, swap):
    cfg = recipe.config(**NVME)
    cfg["precision"] = FP16
    cfg["nvme"] = {"paths": [swap]}
    return infinity.initialize(recipe.build(), cfg)


def _steps(engine, recipe, first, last):
    scales = []
    for micro in recipe.batches()[first:last]:
        for x, y in micro:
            engine.backward(engine(x, y))
            engine.step()
        scales.append(engine.scaler.scale)
    return scales


def test_fp16_loss_scale_grows_every_interval_and_resumes_where_it_was(tmp_path):
    recipe = Recipe(steps=7, grad_clip=0.0)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with _fp16_engine(recipe, str(tmp_path / "a")) as engine:
        scales = _steps(engine, recipe, 0, recipe.steps)
        assert engine.scaler.skipped_steps == 0 and engine.optimizer_steps == recipe.steps
        full = engine.full_state_dict()
    assert scales == [256.0, 512.0, 512.0, 1024.0, 1024.0, 2048.0, 2048.0], "doubles after every 2 clean steps"
    with _fp16_engine(recipe, str(tmp_path / "b")) as engine:
        _steps(engine, recipe, 0, 3)  # the scale is 512 with one clean step counted toward the next doubling
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    with _fp16_engine(recipe, str(tmp_path / "b")) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert engine.scaler.scale == 512.0
        assert _steps(engine, recipe, 3, recipe.steps) == scales[3:], "the growth continues from the saved count"
        resumed = engine.full_state_dict()
    assert all(torch.equal(resumed[k], full[k]) for k in full)


# ---------------------------------------------------------------- gradients on some ranks only


class TwoHeads(nn.Module):
    """Head `b` (most of the unit's elements, so every rank's shard holds part of it) is used by rank 0's
    rows only; head `a` by every rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 4), nn.Linear(16, 64)

    def forward(self, x, use_b):
        out = self.a(x).pow(2).mean()
        return out + self.b(x).pow(2).mean() if use_b else out


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(3)]  # rows 0-1: rank 0, rows 2-3: rank 1


OPT = {"lr": 1e-2, "weight_decay": 0.1, "grad_clip": 0.0, "betas": [0.9, 0.95], "eps": 1e-8}


def _some_ranks_only(rank, world, swap):
    import os
    os.makedirs(swap, exist_ok=True)
    cfg = {"optimizer": OPT, "placement": {"params": "host", "grads": "host", "optimizer": "nvme"},
           "nvme": {"paths": [swap]}}
    with infinity.initialize(TwoHeads(), cfg) as engine:
        for x in _batches():
            rows = x[rank * 2:(rank + 1) * 2]
            engine.backward(engine(rows, use_b=(rank == 0)))
            engine.step()
        return engine.full_state_dict()


def test_a_parameter_with_a_gradient_on_one_rank_only_is_updated_on_all(tmp_path):
    model = TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=OPT["lr"], betas=tuple(OPT["betas"]), eps=OPT["eps"],
                            weight_decay=OPT["weight_decay"])
    for x in _batches():  # the mean over ranks of each rank's loss: b's gradient comes from rank 0's half
        ((model(x[:2], True) + model(x[2:], False)) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = run_distributed(_some_ranks_only, 2, str(tmp_path / "swap"))[0]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")
