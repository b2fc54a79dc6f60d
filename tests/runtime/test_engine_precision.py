"""fp16 compute with fp32 masters: training follows the fp32 run; overflows are skipped.

bf16 is test_bf16_reference's: against a reference doing the same bf16 maths, tighter than one step (the fp32
run's tolerance here was looser than a bf16 run's whole training, so it passed runs that did not train)."""

from __future__ import annotations

import torch

import infinity
from reference import Recipe, reference_run


def train(recipe, precision, steps=None):
    cfg = recipe.config()
    cfg["precision"] = precision
    engine = infinity.initialize(recipe.build(), cfg)
    losses = []
    for micro in recipe.batches()[:steps]:
        for x, y in micro:
            loss = engine(x, y)
            engine.backward(loss)
            losses.append(float(loss.detach()))
            engine.step()
    return engine, losses


def test_fp16_overflow_skips_step_and_halves_scale():
    recipe = Recipe(steps=3, grad_clip=0.0)
    engine, losses = train(recipe, {"compute_dtype": "fp16", "initial_loss_scale": 2.0 ** 40}, steps=1)
    with engine:
        assert engine.scaler.skipped_steps == 1 and engine.optimizer_steps == 0
        assert engine.scaler.scale == 2.0 ** 39
        # Keep going: the scale falls until gradients are finite, then steps apply.
        for micro in recipe.batches() * 10:
            for x, y in micro:
                engine.backward(engine(x, y))
                engine.step()
        assert engine.optimizer_steps > 0 and engine.scaler.scale < 2.0 ** 30


def test_fp16_follows_fp32():
    recipe = Recipe(steps=4)
    ref_losses, _, _ = reference_run(recipe)
    engine, losses = train(recipe, {"compute_dtype": "fp16", "initial_loss_scale": 1024.0})
    engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=0.02)
