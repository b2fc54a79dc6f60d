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


# ---------------------------------------------------------------- Note [token-weighted windows]

def _ragged_window(recipe, seed=11):
    """accum micro-batches of recipe.micro_batch rows whose label-token counts differ (masked prefixes of random
    lengths, one row all masked), so the mean of per-micro-batch means is not the window's token mean."""
    from infinity.models.gpt import synthetic_batch
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in range(recipe.accum):
        x, y = synthetic_batch(recipe.model, recipe.micro_batch, g)
        for row in range(recipe.micro_batch):
            keep = int(torch.randint(1, recipe.model.seq_len + 1, (1,), generator=g)) if (m, row) != (1, 0) else 0
            y[row, :recipe.model.seq_len - keep] = -100
        out.append((x, y))
    return out


def _big_batch_reference(recipe, windows):
    """Plain PyTorch: each window's micro-batches as one big batch, the mean loss over its label tokens."""
    model = recipe.build()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=recipe.betas, eps=recipe.eps,
                            weight_decay=recipe.weight_decay)
    losses, norms = [], []
    for window in windows:
        x, y = (torch.cat(t) for t in zip(*window))
        loss = model(x, y)  # F.cross_entropy: the mean over the targets that are not -100
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items()}


def _weighted_steps(engine, windows, rows=slice(None)):
    """Each window through the engine, every micro-batch's summed loss over the window's items (all ranks' rows),
    with num_items_in_batch; the window's loss (this rank's share), the grad norm after each step."""
    import torch.nn.functional as F
    losses, norms = [], []
    for window in windows:
        items = sum(int((y != -100).sum()) for _, y in window)
        total = 0.0
        for x, y in window:
            logits = engine(x[rows])
            loss = F.cross_entropy(logits.float().flatten(0, 1), y[rows].flatten(), reduction="sum") / items
            engine.backward(loss, num_items_in_batch=items)
            total += loss.item()
        assert engine.step()
        losses.append(total)
        norms.append(engine.last_grad_norm)
    return losses, norms


def test_a_window_weighted_by_its_tokens_is_one_big_batch():
    """Unequal label counts and accumulation 3: the window's summed shares are the big batch's loss, and the
    gradient (its norm, and the parameters after AdamW) the big batch's."""
    recipe = Recipe(accum=3, grad_clip=1e9, micro_batch=2)
    windows = [_ragged_window(recipe, seed) for seed in (11, 12)]
    want_losses, want_norms, want = _big_batch_reference(recipe, windows)
    with infinity.initialize(recipe.build(), recipe.config()) as engine:
        losses, norms = _weighted_steps(engine, windows)
        got = engine.full_state_dict()
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert norms == pytest.approx(want_norms, rel=1e-5)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, k=key: f"{k}: {m}")


def _two_ranks(rank, world, recipe, windows):
    per = recipe.micro_batch // world
    with infinity.initialize(recipe.build(), recipe.config() | {"zero": {"stage": 3}}) as engine:
        losses, norms = _weighted_steps(engine, windows, slice(rank * per, (rank + 1) * per))
        return losses, norms, engine.full_state_dict()


@pytest.mark.slow  # (two spawned processes: ~5 s; `infinity train` and the trainers at world 2 were checked by hand)
def test_a_weighted_window_over_two_ranks_is_one_big_batch():
    """World 2 (gloo): each rank's shares over the window's items on both ranks; their sum is the big batch's."""
    from dist_utils import run_distributed
    recipe = Recipe(accum=3, grad_clip=1e9, micro_batch=2)
    windows = [_ragged_window(recipe, seed) for seed in (11, 12)]
    want_losses, want_norms, want = _big_batch_reference(recipe, windows)
    (l0, n0, got), (l1, n1, _) = run_distributed(_two_ranks, 2, recipe, windows)
    assert [a + b for a, b in zip(l0, l1)] == pytest.approx(want_losses, rel=1e-5)
    assert n0 == pytest.approx(want_norms, rel=1e-5) and n1 == n0
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, k=key: f"{k}: {m}")


def test_a_window_is_weighted_in_every_backward_or_none():
    recipe = Recipe(accum=3)
    with infinity.initialize(recipe.build(), recipe.config()) as engine:
        x, y = _batches(recipe)[0][0]
        engine.backward(engine(x, y), num_items_in_batch=10)
        with pytest.raises(ValueError, match="num_items_in_batch left out inside a window"):
            engine.backward(engine(x, y))
