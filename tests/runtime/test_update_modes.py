"""Note [overlap]: one type per update mode, chosen once from the configuration; the engine asks no mode.

The modes' numerics against plain PyTorch are test_engine_parity's (inline and deferred: every placement,
eager: bitwise the inline step) and test_fresh_params' (each mode with and without kept copies); those
tests check here-named modes through `engine_runs`, which records the mode each run used.
"""

from __future__ import annotations

import ast
import inspect
import os

import pytest
import torch

import infinity
from infinity.config.update_mode import update_mode
from infinity.runtime.update_modes import (
    MODE_TYPES,
    DeferredUpdate,
    EagerUpdate,
    InlineUpdate,
    SpeculativeUpdate,
    UpdateMode,
)
from reference import Recipe

ENGINE = os.path.join(os.path.dirname(infinity.__file__), "runtime", "engine.py")


@pytest.mark.parametrize(("settings", "expected"), [
    ({"overlap": {"optimizer_with_backward": False}}, InlineUpdate),
    ({"overlap": {"optimizer_with_backward": False}, "optimizer": {"grad_clip": 0.0}}, InlineUpdate),
    ({"optimizer": {"grad_clip": 0.0}}, EagerUpdate),
    ({"optimizer": {"grad_clip": 0.0}, "precision": {"compute_dtype": "bf16"}}, EagerUpdate),
    ({"optimizer": {"grad_clip": 1.0}}, DeferredUpdate),  # the update needs the global norm: "auto" waits for it
    ({"optimizer": {"grad_clip": 1.0}, "overlap": {"optimizer_with_backward": True, "speculation": "1GiB"}},
     SpeculativeUpdate),  # (a size speculates)
    ({"optimizer": {"grad_clip": 1.0}, "overlap": {"speculation": 0}}, DeferredUpdate),
    ({"optimizer": {"grad_clip": 0.0}, "precision": {"compute_dtype": "fp16"}}, DeferredUpdate),  # loss scaling
    ({"optimizer": {"grad_clip": 0.0}, "train": {"on_nonfinite": "skip"}}, DeferredUpdate),  # may be skipped
])
def test_the_configuration_selects_one_mode(settings, expected):
    config = infinity.Config.from_dict({"overlap": {"optimizer_with_backward": True}} | settings)
    assert MODE_TYPES[update_mode(config)] is expected  # (with a GPU or without: Note [speculation default])


def test_every_mode_implements_the_interface():
    modes = (InlineUpdate, EagerUpdate, DeferredUpdate, SpeculativeUpdate)
    for cls in modes:
        assert issubclass(cls, UpdateMode) and not inspect.isabstract(cls), cls
    assert [cls.forward_takes_in_order for cls in modes] == [False, False, True, True]
    assert [cls.updates_during_backward for cls in modes] == [False, True, False, True]


def test_the_engine_never_asks_which_mode_runs():
    """No attribute of the mode's configuration, worker or mode type is read by engine.py's code."""
    tree = ast.parse(open(ENGINE).read())
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    deciding = {"optimizer_with_backward", "grad_clip", "on_nonfinite", "worker", "state_read_ahead", "fresh",
                "speculation", "speculates", "journal"}
    assert not attributes & deciding, attributes & deciding
    modes = {"UpdateMode", "InlineUpdate", "EagerUpdate", "DeferredUpdate", "SpeculativeUpdate", "MODE_TYPES",
             "update_mode"}
    assert not names & modes, names & modes
    assert len(open(ENGINE).read().splitlines()) <= 500  # (thin: colocation lives in runtime/colocate.py)


def _update_starts(settings: dict) -> tuple[bool, bool]:
    """Train one window; return whether the parameters changed by the end of the final backward (before
    step()), and whether step() reported an update."""
    recipe = Recipe(steps=1, accum=2, grad_clip=settings.get("grad_clip", 0.0))
    cfg = recipe.config() | {"overlap": {"optimizer_with_backward": settings["overlap"]} | settings.get("more", {})}
    engine = infinity.initialize(recipe.build(), cfg)
    try:
        before = engine.full_state_dict()
        for x, y in recipe.batches()[0]:
            engine.backward(engine(x, y))
        engine.synchronize()  # whatever the final backward issued has landed
        during = engine.full_state_dict()
        changed_in_backward = any(not torch.equal(before[k], during[k]) for k in before)
        stepped = engine.step()
        after = engine.full_state_dict()
        assert stepped and any(not torch.equal(before[k], after[k]) for k in before)
        return changed_in_backward, type(engine.updates).__name__
    finally:
        engine.close()


@pytest.mark.parametrize(("settings", "expected"), [
    ({"overlap": False}, (False, "InlineUpdate")),
    ({"overlap": True, "grad_clip": 0.5}, (False, "DeferredUpdate")),
    ({"overlap": True, "grad_clip": 0.5, "more": {"speculation": "1GiB"}}, (True, "SpeculativeUpdate")),  # (redone)
    ({"overlap": True}, (True, "EagerUpdate")),
])
def test_the_eager_and_speculative_modes_update_during_backward(settings, expected):
    assert _update_starts(settings) == expected
