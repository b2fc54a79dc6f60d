"""Note [speculative update]: with clipping, units are updated during backward as if the clip will not fire, and
put back and updated again when it does; a non-finite window is put back. Bit for bit the deferred update (which
waits for the norm), close to torch AdamW after clip_grad_norm_, and the update's spans start during backward.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import pytest
import torch

import infinity
from engine_runs import engine_run
from infinity.config.update_mode import Mode, update_mode
from infinity.runtime.update_modes import NonFiniteGradError
from reference import Recipe, reference_run

BASE = Recipe(steps=6, accum=2)
DEVICE = {"params": "device", "grads": "device", "optimizer": "device"}
HOST = {"params": "host", "grads": "nvme", "optimizer": "host"}  # (state on NVMe is not speculated)


@pytest.fixture(scope="module")
def recipe():
    """A clip between the run's norms: it fires in some windows and not in others."""
    _, norms, _ = reference_run(dataclasses.replace(BASE, grad_clip=1e9))  # (reports the norms, never clips)
    clip = sorted(norms)[len(norms) // 2]
    fired = [n > clip for n in norms]
    assert any(fired) and not all(fired), norms
    return dataclasses.replace(BASE, grad_clip=clip)


SPECULATE = "64MiB"  # ("auto" never speculates: Note [speculation default])


@pytest.fixture(scope="module")
def deferred_device(recipe, tmp_path_factory):
    """The recipe's deferred run on the device tier (the reference of three tests below)."""
    return _run(recipe, DEVICE, tmp_path_factory.mktemp("deferred"), "d", speculation=0)


def _run(recipe, placement, tmp_path, name, **overlap):
    swap = str(tmp_path / name) if "nvme" in placement.values() else None
    overlap = {"optimizer_with_backward": True, "speculation": SPECULATE} | overlap
    return engine_run(recipe, placement, swap, {"overlap": overlap})


@pytest.mark.parametrize("placement", [DEVICE, pytest.param(HOST, marks=pytest.mark.slow)],
                         ids=["device", "host-nvme-host"])
def test_speculated_updates_are_bitwise_the_deferred_update_and_match_torch(recipe, placement, tmp_path,
                                                                          deferred_device):
    ref_losses, ref_norms, ref_state = reference_run(recipe)
    deferred = deferred_device if placement is DEVICE else _run(recipe, placement, tmp_path, "d", speculation=0)
    speculated = _run(recipe, placement, tmp_path, "s")
    assert (deferred[3]["update_mode"], speculated[3]["update_mode"]) == ("DeferredUpdate", "SpeculativeUpdate")
    assert speculated[3]["working_planned_terms"]["host"]["speculation"] > 0  # (the journal: a host working term)
    assert speculated[0] == deferred[0] and speculated[1] == deferred[1]
    for name, tensor in deferred[2].items():
        assert torch.equal(speculated[2][name], tensor), name
    torch.testing.assert_close(torch.tensor(speculated[0]), torch.tensor(ref_losses))
    for name, tensor in ref_state.items():
        torch.testing.assert_close(speculated[2][name], tensor, msg=lambda m, k=name: f"{k}: {m}")


def test_a_journal_with_room_for_some_units_speculates_those_and_defers_the_rest(recipe, deferred_device):
    """An explicit `overlap.speculation` smaller than the whole journal: the units backward finalizes first are
    speculated, the others wait for the norm; the result is the same, bit for bit."""
    deferred = deferred_device
    cfg = recipe.config(**DEVICE) | {"overlap": {"speculation": 100_000}}
    engine = infinity.initialize(recipe.build(), cfg)
    try:
        speculated = []
        original = engine.updates.journal.reserve

        def reserve(unit, counts):
            entry = original(unit, counts)
            speculated.append((unit, entry is not None))
            return entry
        engine.updates.journal.reserve = reserve
        for micro_batches in recipe.batches():
            for x, y in micro_batches:
                engine.backward(engine(x, y))
                engine.step()
        state = engine.full_state_dict()
    finally:
        engine.close()
    admitted = {u for u, ok in speculated if ok}
    assert admitted and len(admitted) < len({u for u, _ in speculated}), speculated
    for name, tensor in deferred[2].items():
        assert torch.equal(state[name], tensor), name


def test_updates_start_during_backward_in_windows_whose_clip_fires(tmp_path, monkeypatch):
    """The profile's trace: in every window (the clip fires in each), units' update spans begin before backward
    has ended, as without clipping; the redo ("adam again") follows step()."""
    recipe = Recipe(steps=3, accum=1, grad_clip=1e-3)  # fires at every step
    cfg = recipe.config(**DEVICE) | {"profile": {"enabled": True, "trace_dir": str(tmp_path / "trace")},
                                     "overlap": {"speculation": SPECULATE}}
    model = recipe.build()
    speculated = threading.Event()  # a speculated unit's update has been stepped (its span began and ended)
    # the first block's backward waits for it (the blocks after it are final by then): the worker is scheduled
    # during backward on a loaded machine too, whatever the tiny model's own speed; without updates during
    # backward it never is, and the hook gives up after 10 s
    model.blocks[0].register_full_backward_hook(lambda *_: [speculated.wait(10)] and None)
    engine = infinity.initialize(model, cfg)
    step = engine.updates.optimizer.step

    def signalling(*, on_unit_done=None, journal=None, **kwargs):
        def done(unit):
            if on_unit_done is not None:
                on_unit_done(unit)
            if journal is not None and journal.label == "adam":  # (the speculated update, not its redo)
                speculated.set()
        return step(on_unit_done=done, journal=journal, **kwargs)
    monkeypatch.setattr(engine.updates.optimizer, "step", signalling)
    try:
        ends = []
        for micro_batches in recipe.batches():
            for x, y in micro_batches:
                loss = engine(x, y)  # (it waited for every update of the window before: none sets the event now)
                speculated.clear()
                engine.backward(loss)
                ends.append(time.perf_counter())  # backward has ended (the step's norm is not known yet)
                engine.step()
        engine.synchronize()
        spans = engine.profiler.spans()
        fired = engine.updates.fired
    finally:
        engine.close()
    assert fired == recipe.steps
    bounds = [0.0] + ends
    for window, end in enumerate(ends):
        inside = [s for s in spans if bounds[window] <= s.start < end]
        assert any(s.name.startswith("adam u") for s in inside), f"window {window}: no update began in backward"
        after = [s for s in spans if end <= s.start < (ends[window + 1] if window + 1 < len(ends) else math.inf)]
        assert any(s.name.startswith("adam again") for s in after), f"window {window}: the clip fired, no redo"


class _Poison:
    """A full backward hook on one block that makes the gradient reaching the units before it infinite, while
    `on` (the units after it are finite and are speculated first)."""

    def __init__(self):
        self.on = False

    def __call__(self, module, grad_input, grad_output):
        if not self.on:
            return None
        return tuple(None if g is None else g * math.inf for g in grad_input)


def _poisoned_run(recipe, policy: str, speculation, poison_step: int):
    model = recipe.build()
    poison = _Poison()
    model.blocks[1].register_full_backward_hook(poison)
    cfg = recipe.config(**DEVICE) | {"train": {"grad_accum_steps": recipe.accum, "on_nonfinite": policy},
                                     "overlap": {"speculation": speculation}}
    engine = infinity.initialize(model, cfg)
    applied, before, raised = [], None, None
    try:
        for step, micro_batches in enumerate(recipe.batches()):
            poison.on = step == poison_step
            if poison.on:
                before = engine.full_state_dict()
            try:
                for x, y in micro_batches:
                    engine.backward(engine(x, y))
                    applied.append(engine.step())
            except NonFiniteGradError as e:
                raised = e
                break
        state = engine.full_state_dict()
        mode = type(engine.updates).__name__
    finally:
        engine.close()
    return applied, before, state, raised, mode


def test_a_skipped_window_puts_the_speculated_units_back(recipe):
    """on_nonfinite = "skip": the units speculated before the infinite gradient reached the others are put back
    with their Adam step counts; the run goes on bit for bit as the deferred update's, which never touched them."""
    ref = _poisoned_run(recipe, "skip", 0, poison_step=2)
    got = _poisoned_run(recipe, "skip", SPECULATE, poison_step=2)
    assert (ref[4], got[4]) == ("DeferredUpdate", "SpeculativeUpdate")
    assert got[0] == ref[0] and got[0].count(True) == recipe.steps - 1
    for name, tensor in ref[2].items():
        assert torch.equal(got[2][name], tensor), name


def test_an_infinite_gradient_raises_with_nothing_updated(recipe):
    """on_nonfinite = "error" with clipping: the step raises and the state is the one before that window."""
    applied, before, state, raised, mode = _poisoned_run(recipe, "error", SPECULATE, poison_step=1)
    assert mode == "SpeculativeUpdate" and raised is not None and "put back" in str(raised)
    for name, tensor in before.items():
        assert torch.equal(state[name], tensor), name


class _Units:
    """Enough of a unit for the worker: an index and a name."""

    def __init__(self, index):
        self.index, self.name = index, f"u{index}"


class _GatedOptimizer:
    """Steps wait for `gate` from the second call on (the first is the speculated update, the second its redo)."""

    compute_device = torch.device("cpu")

    def __init__(self):
        self.calls, self.gate = 0, threading.Event()

    def step(self, *, units, on_unit_done, **_):
        self.calls += 1
        if self.calls > 1:
            assert self.gate.wait(10)
        for unit in units:
            on_unit_done(unit)


def test_a_unit_with_a_second_update_queued_stays_pending_until_both_are_done():
    """The speculated update and its redo are two batches of one unit: the unit's wait (the next forward's) must
    not return when the first is done."""
    from infinity.optim.worker import OptimizerWorker

    optimizer = _GatedOptimizer()
    worker = OptimizerWorker(optimizer, 1)
    unit = _Units(0)
    try:
        worker.submit([unit], hyper=(), grad_scale=None, active={0: []}, after_unit=lambda u: None)
        worker.submit([unit], hyper=(), grad_scale=2.0, active={0: []}, after_unit=lambda u: None)
        deadline = time.monotonic() + 10
        while optimizer.calls < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert optimizer.calls == 2 and worker.pending(0), "the redo is still running: the unit is not done"
        optimizer.gate.set()
        worker.wait_unit(0)
        assert not worker.pending(0)
    finally:
        optimizer.gate.set()
        worker.close()


def test_a_size_speculates_within_the_free_host_memory_and_auto_never():
    """Note [speculation default]: a size holds the copies it can (master, moments and gradient, fp32, each
    aligned to 64 bytes) up to every unit's; "auto" speculates nowhere (on the H100 the copies cost more than
    waiting for the norm), so its plan has no journal and its mode waits for the norm."""
    from infinity.memory.placement import plan_placement
    from infinity.memory.plan import Budgets, UnitSizes

    sizes = tuple(UnitSizes.uniform(f"u{u}", 1000) for u in range(4))
    static = {"params": "device", "grads": "host", "optimizer": "host"}
    journal = 4 * 4 * (-(-1000 * 4 // 64) * 64)

    def planned(size: int) -> int:
        budgets = Budgets(device=1 << 30, host=1 << 30, nvme=0, shared_ram=False, ram=4 << 30)
        return plan_placement(sizes, torch.float32, policy="static", static=static, budgets=budgets, units_ahead=2,
                              speculation=size, tail_units=0).speculation
    assert planned(1 << 30) == journal  # (every unit's copies: less than the size)
    assert planned(journal // 2) == journal // 2
    clipped = {"optimizer": {"grad_clip": 1.0}, "overlap": {"optimizer_with_backward": True}}
    assert update_mode(infinity.Config.from_dict(clipped)) is Mode.DEFERRED
    assert update_mode(infinity.Config.from_dict(clipped | {"overlap": {"optimizer_with_backward": True,
                                                                        "speculation": "1MiB"}})) is Mode.SPECULATIVE
    budgets = Budgets(device=1 << 30, host=4 * 16_000 + 1000, nvme=0, shared_ram=True, ram=4 << 30)
    with pytest.raises(infinity.ConfigError, match=r"overlap\.speculation = 1MiB would hold .* of pre-update copies, "
                       r"but the plan leaves only .* free under memory\.host_budget"):
        plan_placement(sizes, torch.float32, policy="static", static=static, budgets=budgets, units_ahead=2,
                       speculation=1 << 20, tail_units=0)
