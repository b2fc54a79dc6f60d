"""Prefetch: order recorded and replayed; a changing order (skipped blocks, eval, no_grad) still
trains exactly, with no error and nothing left in flight."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import infinity
from infinity.models.gpt import GPT
from infinity.runtime.prefetch import OrderTrace, TraceState
from infinity.units.unit import UnitState
from reference import TINY, Recipe


class SkippyGPT(GPT):
    """Skips block 1 on odd calls (a data-dependent order change)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls = 0

    def forward(self, idx, targets=None):
        self.calls += 1
        skip = self.calls % 2 == 0
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for i, block in enumerate(self.blocks):
            if skip and i == 1:
                continue
            x = block(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def test_order_trace_records_replays_and_diverges():
    trace = OrderTrace()
    assert trace.on_forward(1, 2) == [] and trace.state is TraceState.RECORDING
    for i in (2, 3):
        trace.on_forward(i, 2)
    assert trace.end_forward() == [1, 2, 3] and trace.state is TraceState.REPLAYING
    assert trace.on_forward(1, 2) == [2, 3]
    assert trace.on_forward(3, 2) == [] and trace.state is TraceState.DIVERGED  # skipped unit 2
    assert trace.end_forward() == [1, 3] and trace.recorded == [1, 3]


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("placement", ["device", "nvme"])
def test_changing_order_trains_like_pytorch(placement, overlap, tmp_path):
    recipe = Recipe(steps=4, accum=1)
    torch.manual_seed(0)
    model = SkippyGPT(TINY)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay)
    cfg = recipe.config(params=placement, grads="host", optimizer=placement)
    cfg["nvme"] = {"paths": [str(tmp_path)]}
    cfg["prefetch"] = {"units_ahead": 2}
    cfg["overlap"] = {"optimizer_with_backward": overlap}
    losses, ref_losses = [], []
    with infinity.initialize(model, cfg) as engine:
        for (x, y), in recipe.batches():
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            ref_loss = ref(x, y)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), recipe.grad_clip)
            opt.step(), opt.zero_grad()
            ref_losses.append(ref_loss.item())
            assert all(u.state is UnitState.SHARDED for u in engine.units), "nothing left unsharded or in flight"
        if placement == "device":  # one rank, parameters on the device: they view the stored shard, no fetches
            assert all(u.aliased for u in engine.units if u.flat_numel)
        elif not overlap:  # with overlap, units still being updated are fetched on demand instead (timing)
            assert engine.prefetcher.issued > 0 and engine.prefetcher.wasted > 0
        state = engine.full_state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")


def test_eval_and_no_grad_forwards_between_steps(tmp_path):
    recipe = Recipe(steps=3, accum=1)
    model = recipe.build()
    cfg = recipe.config(params="nvme", grads="device", optimizer="host")
    cfg["nvme"] = {"paths": [str(tmp_path)]}
    with infinity.initialize(model, cfg) as engine:
        for (x, y), in recipe.batches():
            engine.train()
            engine.backward(engine(x, y))
            engine.step()
            engine.eval()
            with torch.no_grad():
                logits = engine(x)
                again = engine(x)
            torch.testing.assert_close(logits, again)
            assert all(u.state is UnitState.SHARDED for u in engine.units)
        assert os.listdir(tmp_path), "swap files exist while the engine is open"
    assert not any(f.startswith("infinity") for f in os.listdir(tmp_path)), "close() removed its swap files"
