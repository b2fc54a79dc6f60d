"""A unit's lifecycle on its own (units/unit.py): each transition driven through the public calls on a fake
manager and a fake all-gather, the bytes each one makes visible checked against the values the fake stored,
and every move the lifecycle lacks refused."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

import infinity.units.unit as unit_module
from infinity.device.streams import Streams
from infinity.memory.pending import Pending
from infinity.memory.stages import stage_for
from infinity.memory.tier import Kind, Tier
from infinity.profile import NullProfiler
from infinity.units.builder import build_units
from infinity.units.context import UnitContext
from infinity.units.unit import TRANSITIONS, UnitState, UnitStateError


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 5), nn.Linear(5, 2)])


class FakeManager:
    """Stores each unit's whole flat parameters (its `values`); a fetch copies the rank's stored part into the
    target when it is waited, as the real one completes a read at wait."""

    def __init__(self, values: dict[int, torch.Tensor], rank: int, world: int, gathers: bool):
        self.values, self.rank, self.world, self.gathers = values, rank, world, gathers
        self.fetches, self.waits = [], 0

    def tier(self, index, kind):
        return Tier.HOST

    def fetch(self, index, kind, chunk, into, urgent=False):
        assert kind is Kind.PARAMS and urgent
        full = self.values[index]
        part = full.chunk(self.world)[self.rank] if self.gathers else full
        self.fetches.append(index)

        def land():
            self.waits += 1
            into.copy_(part)
        return Pending(result=into, after=land)


def _units(world: int = 1, rank: int = 0, stage: int = 3, group=None):
    ctx = UnitContext(group=group, rank=rank, world_size=world, device=torch.device("cpu"),
                      compute_dtype=torch.float32, streams=Streams.for_device(torch.device("cpu")),
                      profiler=NullProfiler(), stage=stage_for(stage), sub_group_size=4096)
    units = build_units(Blocks(), [], ctx)
    for u in units:
        u.install_views()  # the parameters view the unsharded buffer, as initialize leaves them
    values = {u.index: torch.arange(u.padded_numel, dtype=torch.float32) + 100 * u.index for u in units}
    return units, values


def _flat_params(unit) -> torch.Tensor:
    return torch.cat([s.param.detach().reshape(-1) for s in unit.slots])


def test_one_rank_unshard_then_reshard():
    units, values = _units()
    unit = units[1]
    manager = FakeManager(values, rank=0, world=1, gathers=False)
    assert unit.state is UnitState.SHARDED and unit._storage.nbytes() == 0
    unit.unshard(manager)
    assert unit.state is UnitState.UNSHARDING and manager.fetches == [1] and manager.waits == 0
    unit.unshard(manager)  # issued once: a second call is no new fetch
    assert manager.fetches == [1]
    unit.wait_for_unshard(manager)
    assert unit.state is UnitState.UNSHARDED and manager.waits == 1
    assert torch.equal(_flat_params(unit), values[1][:unit.flat_numel])  # the views read the fetched bytes
    unit.reshard()
    assert unit.state is UnitState.SHARDED and unit._storage.nbytes() == 0
    unit.reshard()  # resharding a sharded unit is nothing
    assert unit.state is UnitState.SHARDED


def test_cancel_waits_for_the_fetch_before_freeing_its_buffer():
    units, values = _units()
    unit = units[2]
    manager = FakeManager(values, rank=0, world=1, gathers=False)
    unit.unshard(manager)
    unit.cancel_unshard(manager)
    assert unit.state is UnitState.SHARDED and manager.waits == 1 and unit._storage.nbytes() == 0
    unit.cancel_unshard(manager)  # nothing in flight: nothing to cancel
    assert manager.waits == 1


class FakeGather:
    """An all-gather over two ranks whose other rank holds the same unit's values: the whole buffer is filled when
    the handle is waited, as an asynchronous collective completes."""

    def __init__(self, values: dict[int, torch.Tensor]):
        self.values, self.calls = values, []  # values by the gathered buffer's numel

    def __call__(self, out, shard, group, async_op=True):
        self.calls.append("issue")
        gather = self

        class Work:
            def wait(self):
                gather.calls.append("wait")
                out.copy_(gather.values[out.numel()])
                return True
        return Work()


def _gathering(monkeypatch, rank: int, index: int):
    """Unit `index` of rank `rank` of two at stage 3, its manager, its all-gather and the values they hold."""
    units, values = _units(world=2, rank=rank, stage=3, group=object())
    unit = units[index]
    gather = FakeGather({unit.padded_numel: values[index]})
    monkeypatch.setattr(unit_module.collectives, "all_gather_into", gather)
    return unit, FakeManager(values, rank=rank, world=2, gathers=True), gather, values[index]


def test_two_ranks_stage_3_unshard_gathers(monkeypatch):
    unit, manager, gather, values = _gathering(monkeypatch, rank=1, index=1)
    unit.unshard(manager)
    assert unit.state is UnitState.UNSHARDING and gather.calls == []
    unit.issue_gather(manager)  # the shard landed; the gather is issued, not waited
    assert unit.state is UnitState.GATHERING and manager.waits == 1 and gather.calls == ["issue"]
    unit.wait_for_unshard(manager)
    assert unit.state is UnitState.UNSHARDED and gather.calls == ["issue", "wait"]
    assert torch.equal(_flat_params(unit), values[:unit.flat_numel])
    unit.reshard()
    assert unit.state is UnitState.SHARDED and unit._storage.nbytes() == 0


def test_cancel_of_an_issued_gather_waits_for_it(monkeypatch):
    unit, manager, gather, _ = _gathering(monkeypatch, rank=0, index=2)
    unit.issue_gather(manager)  # from SHARDED: unshard, then gather
    assert unit.state is UnitState.GATHERING
    unit.cancel_unshard(manager)
    assert unit.state is UnitState.SHARDED and gather.calls == ["issue", "wait"] and unit._storage.nbytes() == 0


def test_every_move_outside_the_table_is_refused():
    units, _ = _units()
    unit = units[1]
    for old, new in itertools.product(UnitState, UnitState):
        unit.state = old
        if (old, new) in TRANSITIONS:
            unit._move(new)
            assert unit.state is new
        else:
            with pytest.raises(UnitStateError, match=f"{old.value} -> {new.value}"):
                unit._move(new)
            assert unit.state is old
