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


def test_floating_inputs_are_cast_to_the_compute_dtype():
    """Note [input dtype]: fp32 features into a bf16 model computed as bf16 (they failed in the first Linear with
    "mat1 and mat2 must have the same dtype"); integer inputs keep theirs. Against the same model in bf16 by hand."""
    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

        def forward(self, x, index):
            return self.b(torch.relu(self.a(x)))[index]

    torch.manual_seed(0)
    model = Regressor()
    reference = Regressor().to(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    x, index = torch.randn(4, 8), torch.tensor([2, 0])
    with infinity.initialize(model, {"precision": {"compute_dtype": "bf16"}}) as engine, torch.no_grad():
        out = engine(x, index)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, reference(x.to(torch.bfloat16), index))
