"""Construction: meta init unit by unit, reproducible across world sizes and placements; sharding
a materialized model frees it; units, tied and frozen parameters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import infinity
import reference
from dist_utils import run_distributed
from infinity.models.gpt import GPT, gpt_init
from reference import TINY, Recipe, reference_run


def meta_state(rank, world, placement, swap_dir):
    with infinity.meta_init():
        model = GPT(TINY)
    cfg = {"placement": placement, "train": {"seed": 7}}
    if swap_dir:
        os.makedirs(swap_dir, exist_ok=True)
        cfg["nvme"] = {"paths": [swap_dir]}
    with infinity.initialize(model, cfg, init_fn=gpt_init) as engine:
        return engine.full_state_dict()


def test_meta_init_allocates_nothing():
    with infinity.meta_init():
        model = GPT(TINY)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.head.weight is model.wte.weight


def test_meta_init_is_identical_across_world_sizes_and_placements(tmp_path):
    host = {"params": "host", "grads": "host", "optimizer": "host"}
    nvme = {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}
    a = meta_state(0, 1, host, None)
    b = meta_state(0, 1, nvme, str(tmp_path / "one"))
    c = run_distributed(meta_state, 2, nvme, str(tmp_path / "two"))[0]
    assert list(a) == list(GPT(TINY).state_dict())
    for key in a:
        assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key]), key
    assert a["wte.weight"].std() < 0.05, "init_fn (nanoGPT's normal(0, 0.02)) was applied"
    assert torch.equal(a["wte.weight"], a["head.weight"])


def test_materialization_holds_one_unit_at_a_time(tmp_path):
    with infinity.meta_init():
        model = GPT(TINY)
    live_counts = []

    def counting_init(module):
        gpt_init(module)
        live = sum(p.numel() for p in model.parameters()  # (a sharded unit's: one NaN, Note [parameters between steps])
                   if p.device.type != "meta" and p.untyped_storage().nbytes() >= p.numel() * p.element_size())
        live_counts.append(live)

    nvme = {"placement": {"params": "nvme", "grads": "host", "optimizer": "host"}, "nvme": {"paths": [str(tmp_path)]}}
    with infinity.initialize(model, nvme, init_fn=counting_init) as engine:
        largest_unit = max(u.flat_numel for u in engine.units)
    assert max(live_counts) <= largest_unit, (max(live_counts), largest_unit)


def test_materialized_model_is_sharded_and_freed(tmp_path):
    model = Recipe().build()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    nvme = {"placement": {"params": "nvme", "grads": "host", "optimizer": "host"}, "nvme": {"paths": [str(tmp_path)]}}
    with infinity.initialize(model, nvme) as engine:
        assert all(p.untyped_storage().nbytes() == p.element_size() for p in model.parameters()), \
            "full copies were freed (each parameter views one NaN: Note [parameters between steps])"
        got = engine.full_state_dict()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_one_rank_on_device_parameters_view_the_stored_shard():
    model = Recipe().build()
    with infinity.initialize(model, {}) as engine:  # defaults: everything on the device tier
        for unit in engine.units:
            stored = engine.manager.resident(unit.index, infinity.Kind.PARAMS)
            for slot in unit.slots:
                assert slot.param.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr()
        assert engine.memory_report()["unsharded_peak_bytes"] == 0


def test_units_by_class_name_equal_automatic_units():
    with infinity.initialize(Recipe().build(), {"units": {"classes": ["Block"]}}) as by_class:
        names = [u.name for u in by_class.units]
    with infinity.initialize(Recipe().build(), {}) as auto:
        assert names == [u.name for u in auto.units] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]


def test_unknown_unit_class_names_the_classes():
    with pytest.raises(ValueError, match="Block"):
        infinity.initialize(Recipe().build(), {"units": {"classes": ["Blok"]}})


def test_model_without_blocks_is_one_root_unit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ref = __import__("copy").deepcopy(model)
    x, y = torch.randn(5, 8), torch.randn(5, 1)
    with infinity.initialize(model, {"optimizer": {"lr": 1e-2}}) as engine:
        assert len(engine.units) == 1
        for _ in range(3):
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        got = engine.full_state_dict()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in range(3):
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value)


def frozen_recipe_model(recipe):
    model = recipe.build()
    model.wpe.weight.requires_grad_(False)
    model.blocks[1].ln1.weight.requires_grad_(False)
    for p in model.blocks[2].parameters():
        p.requires_grad_(False)
    return model


def test_frozen_parameters_stay_frozen_and_the_rest_matches(tmp_path):
    recipe = Recipe()
    model = frozen_recipe_model(recipe)
    ref_losses, _, ref_state = reference_run(recipe, model)
    for placement in ({"params": "device", "grads": "device", "optimizer": "device"},
                      {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}):
        swap = str(tmp_path / "swap")
        os.makedirs(swap, exist_ok=True)
        cfg = recipe.config(**placement)
        cfg["nvme"] = {"paths": [swap]}
        with infinity.initialize(frozen_recipe_model(recipe), cfg) as engine:
            losses = []
            for micro in recipe.batches():
                for x, y in micro:
                    loss = engine(x, y)
                    engine.backward(loss)
                    losses.append(loss.item())
                    engine.step()
            state = engine.full_state_dict()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key], msg=lambda m, k=key: f"{k}: {m}")
        assert torch.equal(state["wpe.weight"], model.wpe.weight.detach())


def test_lr_schedule_callable_matches_lambda_lr():
    recipe = Recipe(grad_clip=0.0)
    schedule = lambda step: 1e-3 * (0.5 ** step)  # noqa: E731
    model = recipe.build()
    ref = __import__("copy").deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=recipe.betas, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    with infinity.initialize(model, recipe.config(), lr_schedule=schedule) as engine:
        for micro in recipe.batches():
            for x, y in micro:
                engine.backward(engine(x, y))
                (ref(x, y) / recipe.accum).backward()
                engine.step()
            opt.step(), opt.zero_grad(), sched.step()
        state = engine.full_state_dict()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value)


def test_a_parameter_read_between_steps_is_nan_not_a_crash(tmp_path):
    """Note [parameters between steps]: a parameter of a sharded unit (here on NVMe) read between steps
    (`model.w.sum()`) killed the process with a segmentation fault (a view of a storage holding no memory). It
    reads as NaN now, with the parameter's shape, dtype and device, and training is what it is without the read
    (full_state_dict equal). In a child process: the bug takes the process with it."""
    code = f"""
import sys, torch, infinity
sys.path.insert(0, {os.path.dirname(os.path.abspath(reference.__file__))!r})
from reference import Recipe
recipe = Recipe(steps=2)
def run(read, where):
    config = recipe.config(params="nvme", grads="host", optimizer="host") | {{"nvme": {{"paths": [where]}}}}
    model, said = recipe.build(), []
    with infinity.initialize(model, config) as engine:
        for micro_batches in recipe.batches():
            for x, y in micro_batches:
                engine.backward(engine(x, y))
            engine.step()
            engine.synchronize()
            if read:
                w = model.blocks[0].fc.weight
                said.append((tuple(w.shape), str(w.dtype), w.device.type, bool(torch.isnan(w.sum()))))
        return said, engine.full_state_dict()
said, read = run(True, {str(tmp_path / "a")!r})
_, unread = run(False, {str(tmp_path / "b")!r})
print(said[-1], all(torch.equal(read[k], unread[k]) for k in unread))
"""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "((128, 32), 'torch.float32', 'cpu', True) True", out.stdout
