"""Export: one consolidated state dict (safetensors and torch.save) from a sharded checkpoint, that
plain PyTorch loads with strict=True, equal to the engine's gathered state."""

from __future__ import annotations

import os

import pytest
import torch

from ckpt_runs import NVME, make_engine, train_steps
from dist_utils import run_distributed
from infinity.state.export import export_checkpoint
from reference import Recipe

RECIPE = Recipe(steps=2)


def train_and_save(rank, world, root, ckpt):
    with make_engine(RECIPE, NVME, root, rank=rank) as engine:
        train_steps(engine, RECIPE, 0, 2, rank, world)
        engine.save_checkpoint(ckpt)
        return engine.full_state_dict()


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def saved(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"export{request.param}")
    ckpt = str(root / "ckpt")
    state = run_distributed(train_and_save, request.param, str(root), ckpt)[0]
    return ckpt, state, root


def test_torch_save_export_loads_strict_into_plain_pytorch(saved):
    ckpt, state, root = saved
    out = export_checkpoint(ckpt, str(root / "model.pt"))
    loaded = torch.load(out, weights_only=True)
    assert list(loaded) == list(state)
    model = RECIPE.build()
    model.load_state_dict(loaded, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert loaded["wte.weight"].data_ptr() == loaded["head.weight"].data_ptr(), "tied weights stay one storage"


def test_safetensors_export_loads_strict(saved):
    safetensors = pytest.importorskip("safetensors.torch")
    ckpt, state, root = saved
    out = export_checkpoint(ckpt, str(root / "model.safetensors"))
    loaded = safetensors.load_file(out)
    assert set(loaded) == set(state)
    RECIPE.build().load_state_dict(loaded, strict=True)
    for key in state:
        assert torch.equal(loaded[key], state[key]), key


def test_export_in_bf16(saved):
    ckpt, state, root = saved
    loaded = torch.load(export_checkpoint(ckpt, str(root / "bf16.pt"), dtype=torch.bfloat16), weights_only=True)
    assert loaded["blocks.0.fc.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["blocks.0.fc.weight"], state["blocks.0.fc.weight"].bfloat16())


def test_engine_export_state_dict(tmp_path):
    with make_engine(RECIPE, NVME, str(tmp_path)) as engine:
        train_steps(engine, RECIPE, 0, 1, 0, 1)
        out = engine.export_state_dict(str(tmp_path / "final.pt"))
        state = engine.full_state_dict()
    loaded = torch.load(out, weights_only=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert not any(n.startswith("final.pt.") for n in os.listdir(tmp_path)), "its temporary checkpoint is removed"
