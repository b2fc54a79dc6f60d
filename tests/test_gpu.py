"""GPU paths: CUDA streams, pinned host tiers, device tier in HBM (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from engine_runs import ALL_PLACEMENTS, engine_run
from reference import Recipe, reference_run

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def exact_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("placement", ALL_PLACEMENTS[::4] + ALL_PLACEMENTS[-1:], ids=lambda p: "-".join(p.values()))
def test_gpu_training_matches_cpu_reference(placement, tmp_path):
    recipe = Recipe()
    ref_losses, _, ref_state = reference_run(recipe)
    swap = str(tmp_path) if "nvme" in placement.values() else None
    losses, _, state, report = engine_run(recipe, placement, swap)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-4)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-3, atol=1e-4)
    assert report["cuda_peak_bytes"] > 0


def test_host_tier_is_pinned_with_cuda():
    import infinity
    from infinity.memory.tier import Kind
    engine = infinity.initialize(Recipe().build(), {"placement": {"params": "host", "grads": "host",
                                                                   "optimizer": "host"}})
    with engine:
        shard = engine.manager._shards[(1, Kind.MASTER)]
        assert shard.resident.is_pinned()
        assert engine.streams.is_cuda and engine.streams.h2d is not None
