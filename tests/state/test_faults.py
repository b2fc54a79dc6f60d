"""Faults below the engine surface: corrupted swap bytes are detected and never trained on; swap
directories on read-only or full filesystems are refused at initialize."""

from __future__ import annotations

import os

import pytest
import torch

import infinity
from infinity.memory.tier import Kind
from io_engine import ChecksumError
from reference import Recipe

NVME = {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}


def config(swap: str, **over) -> dict:
    cfg = Recipe().config(**NVME)
    cfg["nvme"] = {"paths": [swap]}
    cfg.update(over)
    return cfg


def test_flipped_byte_in_swap_is_detected_and_not_trained_on(tmp_path):
    recipe = Recipe()
    # no state read-ahead: it would hold a copy of the master read before the flip, which the update then
    # overwrites (correct, but nothing would read the flipped byte); its read errors: tests/optim/test_read_ahead.py
    engine = infinity.initialize(recipe.build(), config(str(tmp_path), overlap={"optimizer_read_ahead": 0}))
    with engine:
        (x, y), _ = recipe.batches()[0]
        engine.backward(engine(x, y))
        engine.backward(engine(x, y))
        assert engine.step()
        before = engine.full_state_dict()
        # corrupt blocks.0's first Adam moment on disk: only the update reads it (its fp32 master weights
        # are also its parameters, read by the forward: test_flipped_parameter_byte_fails_the_forward)
        part = flip_byte(engine, 1, Kind.EXP_AVG, 100)
        engine.backward(engine(x, y))
        engine.backward(engine(x, y))
        with pytest.raises(ChecksumError) as err:
            engine.step()
            engine.synchronize()  # with overlap the update runs on the worker: its error surfaces at the next wait
        assert part.path in str(err.value) and "offset" in str(err.value)
        with pytest.raises(ChecksumError):
            engine(x, y)  # sticky: nothing trains on after the failed update
        # Nothing trained on the bad bytes: the fp32 masters, read back from the swap now, of the unit with
        # the bad moment and of the units after it are what they were before the failed step. (The root
        # unit, updated first, took its own good update: the step is partial and the engine stays failed.)
        after = masters(engine)
    blocks = [name for name in before if name.startswith("blocks.")]
    assert blocks
    for name in blocks:
        assert torch.equal(after[name], before[name]), f"{name} changed in the failed step"


def masters(engine) -> dict:
    """Every parameter's fp32 master, read from its tier now (one rank: the shard is the whole unit)."""
    m, out = engine.manager, {}
    for unit in engine.units:
        flat = torch.cat([m.fetch(unit.index, Kind.MASTER, c, torch.device("cpu")).wait().clone()
                          for c in range(m.num_chunks(unit.index))])
        for slot in unit.slots:
            for name in slot.names:
                out[name] = flat[slot.offset: slot.offset + slot.numel].view(slot.shape)
    return out


def flip_byte(engine, unit: int, kind: Kind, offset: int):
    """Flip one bit of a stored chunk on disk, under the engine; returns the extent part."""
    part = engine.manager._shards[(unit, kind)].chunks[0].extent.parts[0]
    with open(part.path, "r+b") as f:
        f.seek(part.offset + offset)
        b = f.read(1)
        f.seek(part.offset + offset)
        f.write(bytes([b[0] ^ 0x01]))
    return part


def test_flipped_parameter_byte_fails_the_forward(tmp_path):
    """fp32 parameters on NVMe are read from the master's extents (Note [aliased parameters]): a flipped
    byte there fails the forward that fetches them, naming the file, before anything trains on it."""
    recipe = Recipe()
    cfg = config(str(tmp_path), overlap={"optimizer_read_ahead": 0}, prefetch={"keep_written": False})
    with infinity.initialize(recipe.build(), cfg) as engine:
        for x, y in recipe.batches()[0]:
            engine.backward(engine(x, y))
        assert engine.step()
        engine.synchronize()
        part = flip_byte(engine, 1, Kind.MASTER, 100)
        with pytest.raises(ChecksumError) as err:
            engine(x, y)
        assert part.path in str(err.value) and f"offset {part.offset}" in str(err.value)


@pytest.fixture
def mount(tmp_path):
    made = []

    def make(options: str):
        mnt = tmp_path / f"mnt{len(made)}"
        mnt.mkdir()
        if os.system(f"mount -t tmpfs -o {options} tmpfs {mnt} 2>/dev/null") != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        made.append(mnt)
        return mnt
    yield make
    for mnt in made:
        os.system(f"umount {mnt}")


def test_read_only_swap_directory_is_refused_at_initialize(mount):
    ro = mount("size=4m,ro")
    with pytest.raises(infinity.PreflightError, match=f"{ro}.*not writable"):
        infinity.initialize(Recipe().build(), config(str(ro)))


def test_full_swap_filesystem_is_refused_at_initialize(mount):
    small = mount("size=64k")
    with pytest.raises(infinity.PlacementError, match=r"nvme tier needs .* the nvme.paths have .* free"):
        infinity.initialize(Recipe().build(), config(str(small)))
