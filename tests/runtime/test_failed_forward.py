"""A forward that raises partway (a bad batch, a user's bug caught in a notebook) leaves the engine as it was
before that call: every unit it fetched is released, and training goes on exactly as if the call had not
happened (the reference never sees it)."""

from __future__ import annotations

import pytest
import torch

import infinity
from infinity.units.unit import UnitState
from reference import Recipe, reference_run


class Planted(Exception):
    pass


@pytest.mark.parametrize("placement", [("device", "device", "device"), ("nvme", "host", "nvme")], ids="-".join)
def test_training_after_a_failed_forward_equals_the_reference(placement, tmp_path):
    recipe = Recipe(steps=3, accum=1)
    _, _, want = reference_run(recipe)
    cfg = recipe.config(params=placement[0], grads=placement[1], optimizer=placement[2])
    cfg["nvme"] = {"paths": [str(tmp_path)]}
    model = recipe.build()
    block = model.blocks[1]
    fail = {"on": False}
    original = block.forward

    def forward(*args, **kwargs):
        if fail["on"]:
            raise Planted("a planted failure in block 1's forward")
        return original(*args, **kwargs)

    block.forward = forward
    with infinity.initialize(model, cfg) as engine:
        for step, micro in enumerate(recipe.batches()):
            (x, y), = micro
            if step == 1:  # between two steps, and before the recorded order is replayed
                fail["on"] = True
                with pytest.raises(Planted):
                    engine(x, y)
                fail["on"] = False
                assert all(u.state is UnitState.SHARDED for u in engine.units), \
                    [(u.name, u.state.value) for u in engine.units if u.state is not UnitState.SHARDED]
                with pytest.raises(RuntimeError, match="needs a forward with gradients first"):
                    engine.backward(torch.zeros((), requires_grad=True))  # nothing from the failed call remains
            engine.backward(engine(x, y))
            engine.step()
        got = engine.full_state_dict()
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
