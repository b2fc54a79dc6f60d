"""The CUDA path's logic, tested on the CPU through seams (issue 21): a compute device faked by `meta`
(arithmetic without bytes: a tensor left on the CPU fails the first op that meets a device tensor),
recording stand-ins for torch.cuda's streams, events and set_device, and a count of host syncs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import infinity
import infinity.engine as engine_module
from infinity.environment import resolve
from infinity.hooks import to_device

META = torch.device("meta")


class WithBuffers(nn.Module):
    """Units with BatchNorm statistics; a persistent buffer and a non-persistent one (a mask) at the root;
    a forward that takes nested inputs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(3)])
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("mask", torch.ones(8), persistent=False)

    def forward(self, x, extra):
        h = self.embed(x) * self.scale * self.mask
        for block in self.blocks:
            h = block(h)
        return (h + extra["bias"][0]).square().mean()


@pytest.fixture
def meta_device(monkeypatch):
    """The engine's compute device is `meta`, as if it were a GPU: every tensor the forward meets must be there."""
    monkeypatch.setattr(engine_module, "resolve", lambda group=None: dataclasses.replace(resolve(group), device=META))


def test_inputs_and_buffers_on_the_engine_device(meta_device):
    engine = infinity.initialize(WithBuffers(), {"placement": {"params": "device", "grads": "device",
                                                               "optimizer": "device"},
                                                 "train": {"grad_accum_steps": 2}})  # (no step: no norm on meta)
    with engine:
        buffers = dict(engine.module.named_buffers())
        assert {"scale", "mask", "blocks.0.1.running_mean", "blocks.2.1.num_batches_tracked"} <= set(buffers)
        assert {name: b.device for name, b in buffers.items()} == {name: META for name in buffers}
        loss = engine(torch.randn(5, 4), extra={"bias": [torch.randn(8)]})  # CPU inputs, nested in a dict and list
        assert loss.device == META
        engine.backward(loss)


def test_to_device_moves_every_tensor_of_nested_inputs():
    tree = ([torch.ones(2), 3, "s"], {"a": (torch.zeros(1), None), "b": {"c": torch.arange(3)}})
    moved = to_device(tree, META)
    assert [moved[0][0].device, moved[1]["a"][0].device, moved[1]["b"]["c"].device] == [META] * 3
    assert moved[0][1:] == [3, "s"] and moved[1]["a"][1] is None
