"""Accumulation windows that end early (Note [accumulation windows]): `engine.backward(loss, end_window=True)`.

The reference is plain PyTorch with torch.optim.AdamW and clipping over windows of 3, 3, then 2 micro-batches
(an epoch's shorter last window), each micro-batch's loss scaled by 1/3 as the engine scales it.
"""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from infinity.state.checkpoint import CheckpointError
from reference import Recipe

WINDOWS = [3, 3, 2, 3]  # micro-batches per update; the third window ends early


def _batches(recipe):
    g = torch.Generator().manual_seed(5)
    from infinity.models.gpt import synthetic_batch
    return [[synthetic_batch(recipe.model, recipe.micro_batch, g) for _ in range(n)] for n in WINDOWS]


def _reference(recipe, windows):
    model = recipe.build()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=recipe.betas, eps=recipe.eps,
                            weight_decay=recipe.weight_decay)
    for window in windows:
        for x, y in window:
            (model(x, y) / recipe.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tier, stage, overlap", [("device", 3, False), ("nvme", 3, True), ("host", 1, False),
                                                  ("host", 0, True)],
                         ids=["device-s3", "nvme-s3-worker", "host-s1", "host-s0-worker"])
def test_a_window_ended_early_steps_its_micro_batches(tier, stage, overlap, tmp_path):
    recipe = Recipe(accum=3, grad_clip=0.5)
    windows = _batches(recipe)
    want = _reference(recipe, copy.deepcopy(windows))
    config = recipe.config(params=tier, grads="host" if tier == "nvme" else tier, optimizer=tier) | {
        "zero": {"stage": stage}, "nvme": {"paths": [str(tmp_path)]},
        "overlap": {"optimizer_with_backward": overlap}}
    with infinity.initialize(recipe.build(), config) as engine:
        for window in windows:
            for i, (x, y) in enumerate(window):
                engine.backward(engine(x, y), end_window=i == len(window) - 1)
                if i < len(window) - 1:
                    assert not engine.step()  # inside the window: nothing to apply
            assert engine.step() and not engine.step()  # once per window
            engine.save_checkpoint(str(tmp_path / "between")) if window is windows[2] else None
        got = engine.full_state_dict()
        assert engine.optimizer_steps == len(WINDOWS)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, k=key: f"{k}: {m}")


def test_a_checkpoint_inside_a_window_is_refused(tmp_path):
    recipe = Recipe(accum=3)
    with infinity.initialize(recipe.build(), recipe.config()) as engine:
        x, y = _batches(recipe)[0][0]
        engine.backward(engine(x, y))
        with pytest.raises(CheckpointError, match="inside an accumulation window"):
            engine.save_checkpoint(str(tmp_path / "c"))
