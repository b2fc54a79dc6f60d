"""Checkpoints: bitwise resume in a new process, resharding across world sizes, background saving,
retention, atomicity, and clear errors for missing, foreign or corrupted checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch

import infinity
from ckpt_runs import NVME, load_then_run, make_engine, run_then_save, states_equal, train_steps, uninterrupted
from dist_utils import run_distributed
from infinity.models.gpt import GPT, GPTConfig
from infinity.state.checkpoint import CheckpointError
from reference import Recipe

RECIPE = Recipe(steps=6)


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
# (`-m slow`: 13-15 s each; CI: the background-save test's bitwise resume in process, the 1 -> 2 resharding below)
def test_resume_is_bitwise_identical(world, tmp_path):
    root, ckpt = str(tmp_path), str(tmp_path / "ckpt-3")
    full = run_distributed(uninterrupted, world, RECIPE, NVME, root)
    first = run_distributed(run_then_save, world, RECIPE, NVME, root, ckpt, 3)
    second = run_distributed(load_then_run, world, RECIPE, NVME, root, ckpt)  # new processes
    full_losses, full_state = full[0]
    losses = first[0] + second[0][0]
    assert losses == full_losses, "losses differ from the uninterrupted run"
    assert states_equal(second[0][1], full_state), "parameters differ from the uninterrupted run (torch.equal)"


@pytest.mark.parametrize("saved_world,loaded_world", [pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)])
def test_resharding_resume(saved_world, loaded_world, tmp_path):
    root, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    placement = {"params": "host", "grads": "device", "optimizer": "nvme"}

    def on_ranks(fn, world, *args):  # (world 1 in this process: a spawn costs seconds of imports)
        return [fn(0, 1, *args)] if world == 1 else run_distributed(fn, world, *args)
    full_losses, full_state = on_ranks(uninterrupted, 1, RECIPE, placement, root)[0]
    first = on_ranks(run_then_save, saved_world, RECIPE, placement, root, ckpt, 3)
    losses, state = on_ranks(load_then_run, loaded_world, RECIPE, placement, root, ckpt)[0]
    torch.testing.assert_close(torch.tensor(first[0] + losses), torch.tensor(full_losses))
    for key in full_state:
        torch.testing.assert_close(state[key], full_state[key], msg=lambda m, k=key: f"{k}: {m}")


def test_background_save_becomes_visible_at_next_step_and_resumes_exactly(tmp_path):
    root, ckpt = str(tmp_path), str(tmp_path / "bg")
    extra = {"checkpoint": {"background": True}}
    full_losses, full_state = uninterrupted(0, 1, RECIPE, NVME, root)
    saved_losses = run_then_save(0, 1, RECIPE, NVME, root, ckpt, 3, extra)  # trains one step while saving
    assert saved_losses == full_losses[: len(saved_losses)]
    assert os.path.isfile(os.path.join(ckpt, "manifest.json"))
    losses, state = load_then_run(0, 1, RECIPE, NVME, root, ckpt)
    assert saved_losses[:6] + losses == full_losses
    assert states_equal(state, full_state)


def test_keep_last_removes_only_its_own_checkpoints(tmp_path):
    stranger = tmp_path / "ckpts" / "not-ours"
    stranger.mkdir(parents=True)
    (stranger / "manifest.json").write_text(json.dumps({"format": "infinity-checkpoint/1", "run_id": "other"}))
    with make_engine(Recipe(steps=4), NVME, str(tmp_path), {"checkpoint": {"keep_last": 2}}) as engine:
        for step in range(4):
            train_steps(engine, Recipe(steps=4), step, step + 1, 0, 1)
            engine.save_checkpoint(str(tmp_path / "ckpts" / f"step-{step}"))
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert names == ["not-ours", "step-2", "step-3"], names


def test_missing_checkpoint_is_named(tmp_path):
    with make_engine(Recipe(), NVME, str(tmp_path)) as engine:
        with pytest.raises(CheckpointError, match="no checkpoint at .*nowhere"):
            engine.load_checkpoint(str(tmp_path / "nowhere"))


def test_checkpoint_of_another_model_is_refused(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_then_save(0, 1, Recipe(steps=1), NVME, str(tmp_path), ckpt, 1)
    other = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=4, d_model=48))
    with infinity.initialize(other, {}) as engine:
        with pytest.raises(CheckpointError, match="another model.*shape"):
            engine.load_checkpoint(ckpt)


def test_flipped_byte_in_checkpoint_is_detected_and_nothing_is_trained_on(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_then_save(0, 1, Recipe(steps=1), NVME, str(tmp_path), ckpt, 1)
    data = os.path.join(ckpt, "rank00000.bin")
    with open(data, "r+b") as f:
        f.seek(4096 + 7)
        byte = f.read(1)
        f.seek(4096 + 7)
        f.write(bytes([byte[0] ^ 0x10]))
    with make_engine(Recipe(), NVME, str(tmp_path)) as engine:
        with pytest.raises(CheckpointError, match="checksum mismatch in .*rank00000.bin at offset"):
            engine.load_checkpoint(ckpt)


def test_save_inside_accumulation_window_is_refused(tmp_path):
    recipe = Recipe()
    with make_engine(recipe, NVME, str(tmp_path)) as engine:
        x, y = recipe.batches()[0][0]
        engine.backward(engine(x, y))
        with pytest.raises(CheckpointError, match="accumulation window"):
            engine.save_checkpoint(str(tmp_path / "c"))
        assert not os.path.exists(tmp_path / "c")


def test_existing_path_is_not_overwritten(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "precious.txt").write_text("keep me")
    with make_engine(Recipe(), NVME, str(tmp_path)) as engine:
        with pytest.raises(CheckpointError, match="already exists"):
            engine.save_checkpoint(str(ckpt))
    assert (ckpt / "precious.txt").read_text() == "keep me"


@pytest.fixture
def tiny_fs(tmp_path):
    """A 4 MiB filesystem (tmpfs), where this machine lets us mount one."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=4m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mnt
    os.system(f"umount {mnt}")


SMALL = Recipe(model=GPTConfig(vocab_size=8, seq_len=4, n_layer=1, n_head=1, d_model=8), steps=1)
BIG = Recipe(model=GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=4, d_model=128), steps=1)  # ~7 MB saved


def _save_good(tmp_path, where):
    with make_engine(SMALL, NVME, str(tmp_path)) as small:
        train_steps(small, SMALL, 0, 1, 0, 1)
        small.save_checkpoint(where)


def test_disk_too_full_for_a_save_is_refused_up_front(tmp_path, tiny_fs):
    good = str(tiny_fs / "good")
    _save_good(tmp_path, good)
    with make_engine(BIG, NVME, str(tmp_path)) as engine:
        train_steps(engine, BIG, 0, 1, 0, 1)
        with pytest.raises(CheckpointError, match=r"not enough space in .*small.*bytes missing"):
            engine.save_checkpoint(str(tiny_fs / "too-big"))
        train_steps(engine, BIG, 0, 1, 0, 1)  # the run goes on
    assert sorted(os.listdir(tiny_fs)) == ["good"], "no partial checkpoint is left behind"
    infinity.state.checkpoint_load.read_manifest(good)  # the earlier checkpoint is intact


def test_disk_filling_up_during_a_save_keeps_the_last_checkpoint(tmp_path, tiny_fs, monkeypatch):
    good = str(tiny_fs / "good")
    _save_good(tmp_path, good)
    real = infinity.state.checkpoint.shutil.disk_usage
    monkeypatch.setattr(infinity.state.checkpoint.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1 << 40))  # the space "vanishes" after the check
    with make_engine(BIG, NVME, str(tmp_path)) as engine:
        train_steps(engine, BIG, 0, 1, 0, 1)
        with pytest.raises(CheckpointError, match=r"small/too-big was not saved .*(No space|ENOSPC|is full)"):
            engine.save_checkpoint(str(tiny_fs / "too-big"))
    assert sorted(os.listdir(tiny_fs)) == ["good"], "no partial checkpoint is left behind"
    infinity.state.checkpoint_load.read_manifest(good)
