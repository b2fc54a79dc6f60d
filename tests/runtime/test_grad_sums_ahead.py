"""Note [gradient sums ahead] (runtime/grad_reduce.py): after a window's first backward, each unit's gradient sum so
far is fetched as the unit's backward starts, not when its gradient is done, so the read runs under its backward;
the run trains exactly as plain PyTorch does (tests/runtime/test_engine_parity.py holds every placement), and no
sum fetched ahead outlives its backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import infinity
from engine_runs import train_steps
from infinity.memory.tier import Kind
from reference import Recipe, reference_run

RECIPE = Recipe(steps=3, accum=3)


def _logged(engine, monkeypatch) -> list[tuple[str, int]]:
    """(event, unit) in the order they happen: a unit's backward starting ("pre"), a fetch of its gradient store
    ("fetch"), its gradient done ("done")."""
    log: list[tuple[str, int]] = []
    fetch, before_backward, issue = engine.manager.fetch, engine.prefetcher.before_backward, engine.reducer.issue

    def logged_fetch(unit, kind, *args, **kwargs):
        if kind is Kind.GRADS:
            log.append(("fetch", unit))
        return fetch(unit, kind, *args, **kwargs)

    monkeypatch.setattr(engine.manager, "fetch", logged_fetch)
    monkeypatch.setattr(engine.prefetcher, "before_backward",
                        lambda unit: (log.append(("pre", unit.index)), before_backward(unit))[1])
    monkeypatch.setattr(engine.reducer, "issue",
                        lambda unit, final: (log.append(("done", unit.index)), issue(unit, final=final))[1])
    return log


@pytest.mark.parametrize("grads", ["nvme", "host"])
def test_a_units_gradient_sum_is_fetched_as_its_backward_starts(grads, tmp_path, monkeypatch):
    """Each backward after a window's first fetches every unit's sum (once) between the unit's backward starting and
    its gradient being done (the root's, which ends the backward, when it is done), a window's first backward none;
    the losses and weights are plain PyTorch's; the staging pool holds no buffer once the run is done."""
    config = RECIPE.config(params="host", grads=grads, optimizer="host") | {"nvme": {"paths": [str(tmp_path)]}}
    with infinity.initialize(RECIPE.build(), config) as engine:
        log = _logged(engine, monkeypatch)
        marks = []  # where each backward's events start and end (the update's own fetches are between them)
        backward = engine.backward
        monkeypatch.setattr(engine, "backward", lambda loss: (marks.append(len(log)), backward(loss),
                                                              marks.append(len(log)))[1])
        losses = train_steps(engine, RECIPE, 0, RECIPE.steps, 0, 1)
        state = engine.full_state_dict()
        assert engine.manager.staging._out == {}, "a buffer is still out of the staging pool"
    ref_losses, _, ref_state = reference_run(RECIPE)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], rtol=1e-5, atol=1e-6)
    trainable = sorted({u for e, u in log if e == "done"})
    assert len(marks) == 2 * RECIPE.steps * RECIPE.accum
    for i, (start, end) in enumerate(zip(marks[::2], marks[1::2])):
        events = log[start:end]
        fetched = [u for e, u in events if e == "fetch"]
        if i % RECIPE.accum == 0:
            assert fetched == [], f"backward {i} opens a window: nothing to add to, {events}"
            continue
        assert sorted(fetched) == trainable, (i, events)  # each unit's sum, once
        for unit in trainable[1:]:  # (the root has no backward hook: its sum is read once its gradient is done)
            at = events.index(("fetch", unit))
            assert events.index(("pre", unit)) < at < events.index(("done", unit)), (i, unit, events)


def test_a_sum_fetched_ahead_for_a_unit_without_a_gradient_goes_back(tmp_path, monkeypatch):
    """A sum fetched ahead that no gradient took (as when a backward fails after a unit's backward started) is
    back in the pool when the backward ends, and the window's next backward adds to the stored sums as before."""
    recipe = dataclasses.replace(RECIPE, steps=1)
    config = recipe.config(params="host", grads="nvme", optimizer="host") | {"nvme": {"paths": [str(tmp_path)]}}
    with infinity.initialize(recipe.build(), config) as engine:
        (x, y), second = recipe.batches()[0][:2]
        engine.backward(engine(x, y))
        unit = engine.units[1]
        engine.reducer.fetch_ahead(unit, engine.env.device, window_open=True)  # as its pre-backward would
        assert unit.index in engine.reducer._ahead and engine.manager.staging._out
        engine.reducer.backward_ended()
        assert engine.reducer._ahead == {} and engine.manager.staging._out == {}
        engine.backward(engine(*second))  # (its last gradient store is still in write-behind: a buffer out)
        assert engine.reducer._ahead == {}
