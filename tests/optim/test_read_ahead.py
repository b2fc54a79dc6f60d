"""Note [state read-ahead]: the optimizer worker reads the next update's NVMe state during forward and
backward, within `[overlap] optimizer_read_ahead`; the results are bitwise those of no read-ahead, a
checkpoint loaded meanwhile makes the held copies stale (and they are read again), and the budget holds."""

from __future__ import annotations

import time

import pytest
import torch

import infinity
from engine_runs import train_steps
from infinity.config.sections import ConfigError
from reference import Recipe

STEPS = 4
NVME_OPT = {"params": "device", "grads": "host", "optimizer": "nvme"}


def _engine(tmp_path, name: str, read_ahead, *, clip: float = 0.5, placement=NVME_OPT, sub_group=4096):
    recipe = Recipe(steps=STEPS, accum=1, grad_clip=clip)
    cfg = recipe.config(**placement)
    swap = tmp_path / name
    swap.mkdir()
    cfg["nvme"] = {"paths": [str(swap)]}
    cfg["overlap"] = {"optimizer_with_backward": True, "optimizer_read_ahead": read_ahead}
    cfg["optimizer"]["sub_group_size"] = sub_group  # elements: several chunks per unit
    return recipe, infinity.initialize(recipe.build(), cfg)


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    """Wait for the worker to get somewhere (a condition, not a timing assertion)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.005)


def _full(ra) -> bool:
    """Something is held, and the next chunk in order (if any) would not fit the budget."""
    with ra._lock:
        nxt = next(iter(ra._todo), None)
        return ra.held_bytes > 0 and (nxt is None or ra.held_bytes + ra.chunk_bytes(*nxt) > ra.budget)


def _params(engine) -> dict:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


@pytest.mark.parametrize("clip", [0.5, 0.0], ids=["deferred", "eager"])
def test_read_ahead_is_bitwise_no_read_ahead_and_is_used(clip, tmp_path):
    runs = {}
    for read_ahead in (0, "auto"):
        recipe, engine = _engine(tmp_path, f"ra{read_ahead}", read_ahead, clip=clip)
        ra = engine.updates.optimizer.state_read_ahead
        assert (ra is None) == (read_ahead == 0)
        tasks = len(engine.updates.optimizer.task_chunks({u.index: u.steps.active_ranges([True] * len(u.grads.flags()))
                                                  for u in engine.units}, engine.units))
        losses = []
        for step in range(recipe.steps):
            losses += train_steps(engine, recipe, step, step + 1, 0, 1)
            if ra is not None:  # let the update take its chunks, and the worker read the whole next one ahead
                whole = engine.read_ahead_bytes
                _wait_for(lambda: ra.hits + ra.misses == tasks * (step + 1) and ra.held_bytes == whole
                          and not ra._todo, "the read-ahead of the next update")
        runs[read_ahead] = (losses, _params(engine))
        if ra is not None:
            assert tasks > len(engine.units)  # several sub-groups per unit
            # every update after the first found all of its state already read
            assert ra.hits == tasks * (recipe.steps - 1) and ra.stale == 0
        engine.close()
    assert runs[0][0] == runs["auto"][0]
    for name, tensor in runs[0][1].items():
        assert torch.equal(tensor, runs["auto"][1][name]), name


def test_checkpoint_loaded_meanwhile_makes_held_state_stale(tmp_path):
    recipe, engine = _engine(tmp_path, "a", "auto")
    train_steps(engine, recipe, 0, 1, 0, 1)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    train_steps(engine, recipe, 1, 3, 0, 1)
    ra = engine.updates.optimizer.state_read_ahead
    whole = engine.read_ahead_bytes
    tasks = len(engine.updates.optimizer.task_chunks({u.index: u.steps.active_ranges([True] * len(u.grads.flags()))
                                                      for u in engine.units}, engine.units))
    # (the third update has taken its chunks: the read-ahead then holds the fourth's, not still the third's)
    _wait_for(lambda: ra.hits + ra.misses == 3 * tasks and ra.held_bytes == whole and not ra._todo,
              "the read-ahead of step 4")
    engine.load_checkpoint(str(tmp_path / "ckpt"))  # replaces every chunk the worker holds
    train_steps(engine, recipe, 1, 3, 0, 1)
    assert ra.stale > 0
    resumed = _params(engine)
    engine.close()

    recipe, reference = _engine(tmp_path, "b", 0)
    train_steps(reference, recipe, 0, 3, 0, 1)
    expected = _params(reference)
    reference.close()
    for name, tensor in expected.items():
        assert torch.equal(tensor, resumed[name]), name


def test_budget_bounds_what_is_held(tmp_path):
    recipe, engine = _engine(tmp_path, "a", "100KiB")
    ra = engine.updates.optimizer.state_read_ahead
    chunks = [ra.chunk_bytes(u.index, c) for u in engine.units for c in range(engine.manager.num_chunks(u.index))]
    assert engine.read_ahead_bytes == 100 << 10 and max(chunks) <= 100 << 10 < sum(chunks)  # the budget binds
    held = []
    for step in range(recipe.steps):
        train_steps(engine, recipe, step, step + 1, 0, 1)
        _wait_for(lambda: _full(ra), "the read-ahead to fill its budget")
        held.append(ra.held_bytes)
    assert ra.hits > 0
    engine.close()
    assert all(0 < h <= 100 << 10 for h in held), held


def test_the_read_ahead_staging_is_allocated_at_initialize(tmp_path):
    """Buffers first allocated mid-step pace the reads behind them: initialize allocates what a
    full read-ahead holds, and training then finds every buffer it needs in the pool."""
    recipe, engine = _engine(tmp_path, "a", "auto")
    ra = engine.updates.optimizer.state_read_ahead
    at_init = engine.memory_report()["staging_host_bytes"]
    assert at_init >= engine.read_ahead_bytes == ra.reserve_buffers() > 0
    assert engine.memory_report()["staging_host_bytes"] == at_init  # a second reservation reuses them
    for step in range(recipe.steps):
        train_steps(engine, recipe, step, step + 1, 0, 1)
        _wait_for(lambda: ra.held_bytes == engine.read_ahead_bytes and not ra._todo, "the whole read-ahead")
    # without the reservation the pool grows by at least the whole read-ahead over these steps; with it,
    # only by the few buffers the update's write-behind holds beside a full read-ahead (one page here)
    assert engine.memory_report()["staging_host_bytes"] - at_init < engine.read_ahead_bytes // 4
    engine.close()


@pytest.mark.parametrize("budget", ["all", "three chunks"])
def test_issue_rest_issues_every_chunk_left_within_the_budget_at_once(tmp_path, budget):
    """Note [reads before writes]: past READS_IN_FLIGHT, in order, stopping where the budget does."""
    from infinity.optim.read_ahead import READS_IN_FLIGHT, StateReadAhead
    recipe, engine = _engine(tmp_path, "a", 0)
    active = {u.index: u.steps.active_ranges([True] * len(u.grads.flags())) for u in engine.units}
    order = engine.updates.optimizer.task_chunks(active, engine.units)
    sizes = [StateReadAhead(engine.manager, 1).chunk_bytes(*c) for c in order]
    limit = sum(sizes) if budget == "all" else sum(sizes[:3])
    ra = StateReadAhead(engine.manager, limit)
    ra.set_order(order)
    expected = len(order) if budget == "all" else 3
    assert expected > READS_IN_FLIGHT
    assert ra.issue_rest() == expected
    assert list(ra._held) == order[:expected] and ra.held_bytes == limit
    assert ra.issue_rest() == 0  # nothing left, or no room left
    for chunk in order[:expected]:
        for pending in ra.take(*chunk).values():
            engine.manager.release(pending.wait())
    engine.close()


def test_explicit_read_ahead_larger_than_free_host_memory_is_refused(tmp_path):
    recipe = Recipe(steps=1, accum=1)
    cfg = recipe.config(**NVME_OPT)
    cfg["nvme"] = {"paths": [str(tmp_path)]}
    cfg["memory"] = {"host_budget": "1MiB"}
    cfg["overlap"] = {"optimizer_read_ahead": "1KiB"}
    with pytest.raises(ConfigError, match=r"1KiB is less than one optimizer sub-group's state \(.*\).*raise it"):
        infinity.initialize(recipe.build(), cfg)
    cfg["overlap"] = {"optimizer_read_ahead": "200KiB"}
    with infinity.initialize(recipe.build(), cfg) as engine:  # one that fits
        assert engine.read_ahead_bytes == 200 << 10
    cfg["overlap"] = {"optimizer_read_ahead": "1MiB"}
    with pytest.raises(ConfigError, match=r"overlap\.optimizer_read_ahead = 1MiB would hold .* but the plan leaves "
                                          r"only .* free under memory\.host_budget: lower it"):
        infinity.initialize(recipe.build(), cfg)


def test_read_ahead_needs_the_worker():
    with pytest.raises(ConfigError, match="optimizer_with_backward = true"):
        infinity.Config.from_dict({"overlap": {"optimizer_with_backward": False, "optimizer_read_ahead": "1GiB"}})
    cfg = infinity.Config.from_dict({"overlap": {"optimizer_with_backward": False}})
    assert cfg.overlap.optimizer_read_ahead == "auto"  # auto means none without the worker


def test_a_failed_read_ahead_surfaces_at_the_next_wait_and_is_sticky(tmp_path):
    from infinity.memory.manager import Pending

    class Failed:
        def done(self):
            return True

        def wait(self):
            raise OSError("injected: read of the swap file failed")

    recipe, engine = _engine(tmp_path, "a", "auto")
    ra = engine.updates.optimizer.state_read_ahead
    fetch = engine.manager.fetch

    def failing_fetch(unit, kind, chunk=None, device=None, into=None):
        pending = fetch(unit, kind, chunk, device, into)
        if ra._issuing.locked() and unit == 1:  # the worker reading ahead unit 1
            return Pending(pending.wait(), [Failed()])
        return pending

    engine.manager.fetch = failing_fetch
    train_steps(engine, recipe, 0, 1, 0, 1)
    with pytest.raises(OSError, match="injected"):
        train_steps(engine, recipe, 1, 3, 0, 1)  # step 1's update of unit 1 takes the failed read
        engine.synchronize()
    with pytest.raises(OSError, match="injected"):
        engine.synchronize()  # sticky
    engine.close()  # already reported: close releases everything without raising it again
