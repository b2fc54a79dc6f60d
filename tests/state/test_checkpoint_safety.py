"""Checkpoints restore the model's buffers, load nothing that runs code, verify every file, and never remove
another live process's save in progress."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import infinity
from infinity.state.checkpoint import (
    BUFFERS,
    MANIFEST,
    PARTIAL_MARKER,
    CheckpointError,
    _remove_stale_partials,
    rank_rng,
)


class BatchNormNet(nn.Module):
    """A model whose state is more than its parameters: BatchNorm's running statistics and counter."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)

    def forward(self, x, y):
        return ((self.b(self.bn(self.a(x))) - y) ** 2).mean()


def _engine():
    torch.manual_seed(0)
    return infinity.initialize(BatchNormNet(), {"optimizer": {"lr": 1e-2}})


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of BatchNormNet after 3 steps, and the buffers and RNG draw it should restore."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    with _engine() as engine:
        for _ in range(3):
            engine.backward(engine(x, y))
            engine.step()
        ckpt = str(tmp_path / "ckpt")
        engine.save_checkpoint(ckpt)
        buffers = {k: v.clone() for k, v in engine.module.named_buffers()}
        next_draw = torch.rand(4)
    return ckpt, buffers, next_draw


def test_persistent_buffers_and_rng_are_restored(saved):
    ckpt, buffers, next_draw = saved
    assert buffers["bn.num_batches_tracked"] == 3 and buffers["bn.running_mean"].abs().sum() > 0
    with _engine() as engine:
        torch.manual_seed(99)
        engine.load_checkpoint(ckpt)
        restored = dict(engine.module.named_buffers())
        assert torch.equal(torch.rand(4), next_draw), "the RNG state is the one saved"
    for key, value in buffers.items():
        assert torch.equal(restored[key], value), f"{key}: {restored[key]} restored, {value} saved"


def _flip(path: str, offset: int = -1) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[offset] ^= 0x01
        f.seek(0)
        f.write(data)


@pytest.mark.parametrize("name", [BUFFERS, rank_rng(0)])
def test_a_changed_byte_in_the_buffers_or_rng_file_is_refused(saved, name):
    ckpt, _, _ = saved
    _flip(os.path.join(ckpt, name), 40)
    with _engine() as engine, pytest.raises(CheckpointError, match=f"{name} does not match its checksum"):
        engine.load_checkpoint(ckpt)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.parametrize("content", [b"garbage, not a torch file" * 4, "pickle"], ids=["garbage", "pickled-code"])
def test_a_foreign_rng_file_fails_clearly_and_runs_no_code(saved, content, tmp_path, monkeypatch):
    """Even with a matching checksum (an attacker rewrites the manifest too) nothing is unpickled."""
    import json
    import zlib
    ckpt, _, _ = saved
    monkeypatch.chdir(tmp_path)
    path = os.path.join(ckpt, rank_rng(0))
    if content == "pickle":
        torch.save({"torch": _Evil()}, path)
    else:
        with open(path, "wb") as f:
            f.write(content)
    manifest_path = os.path.join(ckpt, MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    with open(path, "rb") as f:
        manifest["ranks"][0]["rng_crc32"] = zlib.crc32(f.read())
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with _engine() as engine, pytest.raises(CheckpointError, match=r"rng.pt cannot be read as the checkpoint's "
                                                                   r"RNG states .*use another checkpoint"):
        engine.load_checkpoint(ckpt)
    assert not (tmp_path / "PWNED").exists(), "loading a checkpoint ran code from it"


def test_no_torch_load_in_the_package_unpickles_code():
    import pathlib
    root = pathlib.Path(infinity.__file__).parent
    for file in root.rglob("*.py"):
        for n, line in enumerate(file.read_text().splitlines(), 1):
            if "torch.load(" in line and not line.lstrip().startswith(("#", '"', "`")):
                assert "weights_only=True" in line, f"{file}:{n}: {line.strip()}"


# ---------------------------------------------------------------- partial saves in use

HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(60)
""")


def _partial(parent, name):
    d = parent / name
    d.mkdir(parents=True)
    (d / PARTIAL_MARKER).write_text("")
    (d / "rank00000.bin").write_bytes(b"x" * 100)
    return d


def test_stale_partials_go_but_a_live_save_in_progress_stays(tmp_path):
    dead, live = _partial(tmp_path, "step-2.tmp-aaaa"), _partial(tmp_path, "step-4.tmp-bbbb")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(live / PARTIAL_MARKER)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        _remove_stale_partials(str(tmp_path))
        assert not dead.exists(), "the partial of a save whose process is gone is removed"
        assert live.exists(), "another live process's save in progress was removed"
    finally:
        holder.kill()
        holder.wait()
    _remove_stale_partials(str(tmp_path))  # the kill released its flock: now it is stale
    assert not live.exists()


def test_a_save_in_progress_holds_its_partial(tmp_path, monkeypatch):
    """Between begin and commit (a background save), another cleanup does not take the partial away."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    torch.manual_seed(0)
    with infinity.initialize(BatchNormNet(), {"optimizer": {"lr": 1e-2}, "checkpoint": {"background": True}}) as e:
        e.backward(e(x, y))
        e.step()
        e.save_checkpoint(str(tmp_path / "ckpts" / "step-1"))
        partials = [n for n in os.listdir(tmp_path / "ckpts") if ".tmp-" in n]
        assert partials, "the save is still a partial until the next step commits it"
        _remove_stale_partials(str(tmp_path / "ckpts"))
        assert all((tmp_path / "ckpts" / n).exists() for n in partials), "a live save's partial was removed"
        e.backward(e(x, y))
        e.step()  # commits it
    assert os.listdir(tmp_path / "ckpts") == ["step-1"]


def test_a_background_save_that_fails_loses_no_update(tmp_path, monkeypatch):
    """The failed save surfaces at the next backward() (eager updates) or step(), which then did nothing;
    calling it again goes on, so the run ends exactly where one that never saved does (the soak relies on
    it: benchmarks/bench_soak.py)."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(4)]

    def run(save_fails: bool, clip: float):
        failures = []

        def again(call, *args):
            try:
                return call(*args)
            except CheckpointError as e:
                failures.append(e)
                return call(*args)
        torch.manual_seed(0)
        cfg = {"optimizer": {"lr": 1e-2, "grad_clip": clip}, "checkpoint": {"background": True}}
        with infinity.initialize(BatchNormNet(), cfg) as engine:
            for i, (x, y) in enumerate(batches):
                again(engine.backward, engine(x, y))
                assert again(engine.step)
                if i == 1 and save_fails:
                    engine.save_checkpoint(str(tmp_path / "ckpt"))
            assert len(failures) == int(save_fails)
            return engine.full_state_dict()
    real = infinity.state.checkpoint.shutil.disk_usage
    monkeypatch.setattr(infinity.state.checkpoint.shutil, "disk_usage", lambda p: real(p)._replace(free=0))
    for clip in (0.0, 1.0):  # eager updates during backward, and the sequential step
        failed, clean = run(True, clip), run(False, clip)
        assert not os.listdir(tmp_path)
        assert all(torch.equal(failed[k], clean[k]) for k in clean)


def test_keep_last_holds_across_resumes(tmp_path):
    """A job killed and resumed again and again keeps at most keep_last (+ the one it loaded) checkpoints."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    ckpts = tmp_path / "ckpts"
    step = 0
    for restart in range(4):
        torch.manual_seed(0)
        with infinity.initialize(BatchNormNet(), {"optimizer": {"lr": 1e-2}, "checkpoint": {"keep_last": 2}}) as e:
            if restart:
                latest = max(os.listdir(ckpts))
                step = e.load_checkpoint(str(ckpts / latest))["step"]
            for _ in range(3):
                e.backward(e(x, y))
                e.step()
                step += 1
                e.save_checkpoint(str(ckpts / f"step-{step:03d}"), user_state={"step": step})
        assert sorted(os.listdir(ckpts)) == [f"step-{step - 1:03d}", f"step-{step:03d}"], restart


def test_keep_last_orders_checkpoints_by_step_through_skipped_updates(tmp_path):
    """Two checkpoints around a skipped (non-finite) step hold the same count of applied updates; resumed from the
    first, the second is after it, not "written before": keep_last must not count it and then prune the one the
    run was loaded from (checkpoints are ordered by the windows stepped, Note [a resumed run keeps its
    checkpoints in bounds])."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    config = {"optimizer": {"lr": 1e-2}, "checkpoint": {"keep_last": 2}, "train": {"on_nonfinite": "skip"}}
    ckpts = tmp_path / "ckpts"
    torch.manual_seed(0)
    with infinity.initialize(BatchNormNet(), config) as e:
        for step, scale in ((1, 1.0), (2, float("nan"))):
            e.backward(e(x, y) * scale)
            e.step()
            e.save_checkpoint(str(ckpts / f"step-{step:03d}"))
        assert e.optimizer_steps == 1
    torch.manual_seed(0)
    with infinity.initialize(BatchNormNet(), config) as e:
        e.load_checkpoint(str(ckpts / "step-001"))
        e.backward(e(x, y))
        e.step()
        e.save_checkpoint(str(ckpts / "step-002b"))
    assert sorted(os.listdir(ckpts)) == ["step-001", "step-002", "step-002b"]
