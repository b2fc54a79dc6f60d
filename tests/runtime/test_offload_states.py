"""offload_states / reload_states between steps (Note [offloaded states]): training after any sequence of them is
bitwise the training without them (the engine's own run is the reference: plain PyTorch parity is
test_engine_parity's), the device tier is empty while offloaded, as the byte model says, and the calls that would
read offloaded state, or an offload in the middle of a step, are refused naming the fix."""

from __future__ import annotations

import pytest
import torch

import infinity
from dist_utils import run_distributed
from engine_runs import train_steps
from reference import Recipe

RECIPE = Recipe(steps=3)
DEVICE = {"params": "device", "grads": "device", "optimizer": "device"}
MIXED = {"params": "device", "grads": "host", "optimizer": "device"}
NVME = {"params": "device", "grads": "device", "optimizer": "nvme"}
SWAP_GARBAGE = 1 << 16  # floats allocated and filled while offloaded, so freed bytes are reused, not found intact


def run(placement: dict, stage: int, between, root=None, rank: int = 0, world: int = 1, overlap: bool = False):
    """Losses and the final state (rank 0) of RECIPE, with `between(engine, step)` after every step."""
    cfg = RECIPE.config(**placement)
    cfg["zero"] = {"stage": stage}
    cfg["overlap"] = {"optimizer_with_backward": overlap}
    if "nvme" in placement.values():
        cfg["nvme"] = {"paths": [str(root / f"swap{rank}")]}
        (root / f"swap{rank}").mkdir(exist_ok=True)
    losses = []
    with infinity.initialize(RECIPE.build(), cfg) as engine:
        for step in range(RECIPE.steps):
            losses += train_steps(engine, RECIPE, step, step + 1, rank, world)
            between(engine, step)
        return losses, engine.full_state_dict()


def nothing(engine, step):
    pass


def offload_everything(engine, step):
    engine.offload_states()
    engine.offload_states()  # idempotent
    garbage = [torch.full((SWAP_GARBAGE,), float("nan")) for _ in range(8)]  # take the freed memory
    del garbage
    engine.reload_states()
    engine.reload_states()  # idempotent


def offload_in_parts(engine, step):
    """Subsets, in turn and overlapping: the optimizer alone, then everything, one reload."""
    engine.offload_states(kinds="optimizer")
    engine.offload_states(kinds=["params", "buffers"])
    engine.offload_states()
    engine.reload_states()
    if step == 1:
        engine.offload_states(kinds=["grads", "master"])
        engine.reload_states()


def same(a, b):
    assert a[0] == b[0], "losses"
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("between", [offload_everything, offload_in_parts], ids=["all", "parts"])
def test_training_after_offloads_is_bitwise_the_same(stage, between):
    same(run(DEVICE, stage, between), run(DEVICE, stage, nothing))


@pytest.mark.parametrize("placement,overlap", [(MIXED, True), (NVME, False), (NVME, True)], ids=["mixed-overlap",
                                                                                            "nvme", "nvme-overlap"])
def test_at_other_placements_and_to_nvme(placement, overlap, tmp_path):
    def to_nvme(engine, step):
        engine.offload_states(tier="nvme")
        assert engine.memory_report()["tier_totals"]["device"] == 0
        engine.reload_states()
    between = to_nvme if "nvme" in placement.values() else offload_everything
    same(run(placement, 3, between, tmp_path, overlap=overlap), run(placement, 3, nothing, tmp_path, overlap=overlap))


def _world2(rank, world, root):
    import pathlib
    out = []
    for stage in (1, 3):
        out.append((run(DEVICE, stage, offload_everything, pathlib.Path(root), rank, world),
                    run(DEVICE, stage, nothing, pathlib.Path(root), rank, world)))
    return out


def test_at_world_two(tmp_path):
    for rank_out in run_distributed(_world2, 2, str(tmp_path)):
        for offloaded, plain in rank_out:
            same(offloaded, plain)


def test_device_tier_empty_while_offloaded_as_the_byte_model_says():
    with infinity.initialize(RECIPE.build(), RECIPE.config(**MIXED)) as engine:
        train_steps(engine, RECIPE, 0, 1, 0, 1)
        before = engine.memory_report()
        assert before["tier_totals"]["device"] > 0
        moved = engine.offload_states()
        report = engine.memory_report()
        assert report["tier_totals"]["device"] == 0 and report["unsharded_pool_bytes"] == 0
        assert report["state"] == report["plan"], "the manager's bytes are the byte model's"
        state = before["state"]
        params_and_optimizer = sum(v for k, v in state["device"].items() if k != "grads")
        assert moved == params_and_optimizer, "gradients are zero between windows: nothing of them moves"
        assert report["tier_totals"]["host"] == before["tier_totals"]["host"] + moved
        assert report["offloaded"] == {"params": "host", "grads": "host", "master": "host", "exp_avg": "host",
                                       "exp_avg_sq": "host", "buffers": "host"}
        engine.reload_states()
        back = engine.memory_report()
        assert back["state"] == before["state"] and back["plan"] == before["plan"] and back["offloaded"] == {}


def test_profile_shows_offload_and_reload(tmp_path):
    cfg = RECIPE.config(**DEVICE) | {"profile": {"enabled": True, "trace_dir": str(tmp_path)}}
    with infinity.initialize(RECIPE.build(), cfg) as engine:
        train_steps(engine, RECIPE, 0, 1, 0, 1)
        engine.offload_states()
        engine.reload_states()
        names = [s.name.split()[0] for s in engine.profiler.spans()]
        engine.profiler.clear()
    assert names.count("offload_states") == 1 and names.count("reload_states") == 1


def test_refused_in_the_middle_of_a_step_and_while_offloaded():
    x, y = RECIPE.batches()[0][0]
    with infinity.initialize(RECIPE.build(), RECIPE.config(**DEVICE)) as engine:
        loss = engine(x, y)
        with pytest.raises(RuntimeError, match="backward is pending"):
            engine.offload_states()
        engine.backward(loss)
        with pytest.raises(RuntimeError, match="1 of 2 backward passes"):
            engine.offload_states()
        engine.backward(engine(x, y))
        with pytest.raises(RuntimeError, match="awaits engine.step"):
            engine.offload_states()
        engine.step()
        with pytest.raises(ValueError, match="unknown \\['optimiser'\\]"):
            engine.offload_states(kinds="optimiser")
        with pytest.raises(ValueError, match="swap space"):
            engine.offload_states(tier="nvme")
        engine.offload_states(kinds="optimizer")
        with torch.no_grad():
            engine(x, y)  # a forward reads parameters and buffers only: a reference model's forward
        loss = engine(x, y)
        with pytest.raises(RuntimeError, match=r"offloaded \(exp_avg, exp_avg_sq, master\).*reload_states"):
            engine.backward(loss)
        engine.reload_states()
        engine.backward(loss)
        engine.backward(engine(x, y))
        engine.step()
        with torch.no_grad():
            want = engine(x, y)
        engine.offload_states()
        with pytest.raises(RuntimeError, match="reload_states"):
            engine(x, y)
        engine.reload_states()
        with torch.no_grad():
            assert torch.equal(engine(x, y), want)
