"""Note [whole-unit updates] (optim/offloaded.py): a unit whose optimizer state and gradients are all on the device
tier is updated in one task over its whole update range, not sub-group by sub-group; the result is the chunked
update's, bit for bit, with fp32 and bf16 state and parameter groups cut across sub-groups."""

from __future__ import annotations

import pytest
import torch

import infinity
from engine_runs import engine_run
from reference import Recipe

SMALL_CHUNKS = {"optimizer": {"sub_group_size": 700}}  # several sub-groups per unit
DEVICE = {"params": "device", "grads": "device", "optimizer": "device"}
HOST = {"params": "device", "grads": "host", "optimizer": "host"}


def test_a_device_tier_unit_is_one_task_and_a_host_tier_unit_one_per_sub_group():
    recipe = Recipe(steps=1)
    for placement, whole in ((DEVICE, True), (HOST, False)):
        cfg = recipe.config(**placement) | SMALL_CHUNKS
        with infinity.initialize(recipe.build(), cfg) as engine:
            optimizer, units = engine.updates.optimizer, engine.units
            active = {u.index: [(0, engine.manager.chunk_span(u.index, None)[1], 1, 0)] for u in units}
            tasks = optimizer.plan_tasks(active, units)
            chunks = {u.index: engine.manager.num_chunks(u.index) for u in units}
        assert max(chunks.values()) > 1, chunks
        if whole:
            assert [(t.unit.index, t.chunk) for t in tasks] == [(u.index, None) for u in units]
            assert optimizer.task_chunks(active, units) == []  # (nothing to read ahead)
        else:
            assert len(tasks) == sum(chunks.values()) and None not in {t.chunk for t in tasks}


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "worker"])
def test_whole_unit_updates_train_bit_for_bit_as_chunked_ones(state_dtype, overlap):
    """The device tier (whole units) against the host tier (sub-group by sub-group), both in RAM here: the same
    losses and parameters, bit for bit, clipping included (the deferred update on the worker)."""
    recipe = Recipe(steps=3)
    extra = SMALL_CHUNKS | {"optimizer": {"sub_group_size": 700, "state_dtype": state_dtype},
                            "overlap": {"optimizer_with_backward": overlap}}
    whole = engine_run(recipe, DEVICE, None, extra)
    chunked = engine_run(recipe, HOST, None, extra)
    assert whole[0] == chunked[0]
    for name, tensor in chunked[2].items():
        assert torch.equal(whole[2][name], tensor), name
