"""Preflight: the one NVMe path check (a path that is a file) and the checkpoints' disk space."""

from __future__ import annotations

import collections
import os

import pytest

import infinity
import infinity.machine.preflight as pf
from infinity.job.cli import EXIT_USAGE, main
from reference import Recipe

SMALL = ["--set", "model.n_layer=2", "--set", "model.d_model=32", "--set", "model.n_head=2"]
ON_NVME = {"placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"}}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_CACHE_DIR", str(tmp_path / "cache"))


# ---------------------------------------------------------------- an nvme path that is a file


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "swapfile"
    path.write_text("not a directory")
    return path


def test_an_nvme_path_that_is_a_file_is_named_at_initialize(a_file):
    with pytest.raises(infinity.PreflightError, match=f"{a_file} is a file, not a directory.*point nvme.paths"):
        infinity.initialize(Recipe().build(), {**ON_NVME, "nvme": {"paths": [str(a_file)]}})
    with pytest.raises(infinity.PreflightError, match=f"is below {a_file}, which is a file"):
        infinity.initialize(Recipe().build(), {**ON_NVME, "nvme": {"paths": [str(a_file / "swap")]}})


def test_an_nvme_path_that_is_a_file_exits_2_from_train_and_estimate(a_file, tmp_path, capsys):
    """Before: train raised FileExistsError from os.makedirs, estimate said "no nvme.paths are set"."""
    runs = tmp_path / "runs"
    for command in ("train", "estimate"):
        code = main([command, *SMALL, "--set", f"run.dir={runs}", "--set", f'nvme.paths=["{a_file}"]',
                     "--set", "run.steps=1"])
        err = capsys.readouterr().err
        assert code == EXIT_USAGE, (command, err)
        assert f"{a_file} is a file, not a directory" in err and "point nvme.paths at a directory" in err, err
        assert "Traceback" not in err and "have no room" not in err
    assert not runs.exists()  # the refused train left nothing behind
    assert a_file.read_text() == "not a directory"


def test_estimate_report_names_the_file_instead_of_missing_paths(a_file):
    from infinity.job.spec import load_job
    from infinity.models.build import build_model
    from infinity.plan import estimate as est
    job = load_job(None, [*SMALL[1::2], "placement.optimizer=nvme", f'nvme.paths=["{a_file}"]'])
    result = est.estimate(lambda: build_model(job.model), job.engine_config("unused"), batch_size=1, seq_len=16)
    assert not result.ok and result.plan is None
    assert "is a file" in result.plan_error and "have no room" not in result.plan_error
    assert any(not c.ok and "is a file" in c.detail for c in result.checks)


def test_a_disk_within_its_headroom_is_no_room_not_an_unusable_path(tmp_path, monkeypatch):
    """A swap disk with less free space than memory.headroom keeps (100 GiB, 5 GiB free: a 10 GiB margin) gives
    the NVMe tier no room, said as such; it is not a path that cannot hold swap, whose failure replaces the plan
    (planted: the space check counted as the path's own failure: the estimate then says " for 1 rank(s) needs
    0B, ..." with no plan and no reason; this fails)."""
    from infinity.job.spec import load_job
    from infinity.models.build import build_model
    from infinity.plan import estimate as est
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(pf.shutil, "disk_usage", lambda path: usage(100 << 30, 95 << 30, 5 << 30))
    job = load_job(None, [*SMALL[1::2], "placement.optimizer=nvme", f'nvme.paths=["{tmp_path}"]'])
    result = est.estimate(lambda: build_model(job.model), job.engine_config("unused"), batch_size=1, seq_len=16)
    assert not result.ok and result.budgets.nvme == 0
    assert result.plan_error.startswith("the placement does not fit: nvme tier needs"), result.plan_error
    assert "the nvme.paths have no room" in result.plan_error and "memory.headroom" in result.plan_error


# ---------------------------------------------------------------- checkpoint space


def saved_rank_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path) if name.startswith("rank"))


def test_checkpoint_bytes_cover_what_a_checkpoint_writes(tmp_path):
    """checkpoint_bytes(plan) against the files a real save leaves: the records exactly, the rest in the margin."""
    engine = infinity.initialize(Recipe().build(), {"optimizer": {"sub_group_size": 1000}})  # several sub-groups
    with engine:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        engine.wait_for_checkpoint()
        predicted = pf.checkpoint_bytes(engine.plan)
    records = os.path.getsize(tmp_path / "ckpt" / "rank00000.bin")
    # master, exp_avg, exp_avg_sq of every sub-group, each padded to 4 KiB (the file ends with the last one unpadded)
    assert records <= predicted - pf.checkpoint_metadata(engine.plan) < records + 4096
    assert saved_rank_bytes(tmp_path / "ckpt") <= predicted


def fake_disk(monkeypatch, free_of: dict):
    """shutil.disk_usage reporting `free_of[path]` bytes free (the real free space elsewhere)."""
    real = pf.shutil.disk_usage
    usage = collections.namedtuple("usage", "total used free")

    def disk_usage(path):
        for prefix, free in free_of.items():
            if str(path).startswith(str(prefix)):
                return usage(free, 0, free)
        return real(path)
    monkeypatch.setattr(pf.shutil, "disk_usage", disk_usage)


@pytest.mark.parametrize("keep_last", [1, 2])
def test_preflight_counts_keep_last_plus_one_checkpoints(tmp_path, monkeypatch, keep_last):
    ckpts = tmp_path / "run"
    cfg = {"checkpoint": {"dir": str(ckpts), "keep_last": keep_last}}
    one = pf.checkpoint_bytes(infinity.initialize(Recipe().build(), {}).plan)
    fake_disk(monkeypatch, {tmp_path: (keep_last + 1) * one - 1})  # one byte short of keep_last + 1
    with pytest.raises(infinity.PreflightError) as e:
        infinity.initialize(Recipe().build(), cfg)
    msg = str(e.value)
    assert f"{keep_last + 1} checkpoint(s)" in msg and f"checkpoints in {ckpts}" in msg
    assert "[checkpoint] keep_last" in msg and "another disk" in msg and "free space there" in msg
    fake_disk(monkeypatch, {tmp_path: (keep_last + 1) * one})  # exactly enough
    infinity.initialize(Recipe().build(), cfg).close()


def test_swap_and_checkpoints_on_one_disk_need_room_for_both(tmp_path, monkeypatch):
    cfg = {**ON_NVME, "nvme": {"paths": [str(tmp_path / "swap")]}, "checkpoint": {"dir": str(tmp_path)}}
    (tmp_path / "swap").mkdir()
    with infinity.initialize(Recipe().build(), cfg) as engine:
        plan = engine.plan
    swap = sum(plan.state_bytes()[infinity.Tier.NVME].values())
    checks, _ = pf.check_disks([str(tmp_path / "swap")], nvme_bytes=swap, local_world_size=2,
                               checkpoint_dir=str(tmp_path), checkpoint_bytes=pf.checkpoint_bytes(plan), checkpoints=1)
    disk = [c for c in checks if c.name.startswith("free disk on")]
    assert len(disk) == 1 and "of swap" in disk[0].detail and "checkpoint(s)" in disk[0].detail  # one filesystem
    need = 2 * (swap + pf.checkpoint_bytes(plan))
    fake_disk(monkeypatch, {tmp_path: need - 1})
    checks, _ = pf.check_disks([str(tmp_path / "swap")], nvme_bytes=swap, local_world_size=2,
                               checkpoint_dir=str(tmp_path), checkpoint_bytes=pf.checkpoint_bytes(plan), checkpoints=1)
    assert not next(c for c in checks if c.name.startswith("free disk on")).ok
    fake_disk(monkeypatch, {tmp_path: need})
    checks, _ = pf.check_disks([str(tmp_path / "swap")], nvme_bytes=swap, local_world_size=2,
                               checkpoint_dir=str(tmp_path), checkpoint_bytes=pf.checkpoint_bytes(plan), checkpoints=1)
    assert next(c for c in checks if c.name.startswith("free disk on")).ok


def test_estimate_reports_the_checkpoint_space(tmp_path):
    from infinity.job.spec import load_job
    from infinity.models.build import build_model
    from infinity.plan import estimate as est
    job = load_job(None, [*SMALL[1::2], "placement.optimizer=host", "placement.params=host",
                         "run.steps=40", "run.checkpoint_every=5"])
    config = job.engine_config("unused").with_overrides([f'checkpoint.dir="{tmp_path}"', "checkpoint.keep_last=3"])
    result = est.estimate(lambda: build_model(job.model), config, batch_size=1, seq_len=16)
    disk = next(c for c in result.checks if c.name.startswith("free disk on"))
    assert disk.ok and "4 checkpoint(s)" in disk.detail and f"checkpoints in {tmp_path}" in disk.name


@pytest.mark.parametrize("steps,every,start", [(40, 5, 0), (40, 5, 20), (41, 5, 3), (7, 0, 0), (10, 10, 0)])
def test_a_job_counts_the_checkpoints_it_saves_so_preflight_holds_them_all(steps, every, start, tmp_path):
    """With keep_last = 0 (keep all) the disk must hold every checkpoint the run saves (one was counted, and a
    run that passed preflight failed at its fourth save); the count as the loop saves them: every
    checkpoint_every steps after `start`, but the last step's is the final one."""
    from infinity.job.spec import load_job
    job = load_job(None, [f"run.steps={steps}", f"run.checkpoint_every={every}"])
    saved = [s for s in range(start + 1, steps + 1) if every and s % every == 0 and s != steps] + ["final"]
    config = job.engine_config(str(tmp_path), start)
    assert config.checkpoint.saves == len(saved)
    assert pf.checkpoints_kept(config) == len(saved)
    for keep in (1, 2, 50):
        kept = load_job(None, [f"run.steps={steps}", f"run.checkpoint_every={every}",
                               f"checkpoint.keep_last={keep}"]).engine_config(str(tmp_path), start)
        assert pf.checkpoints_kept(kept) == min(keep + 1, len(saved))
    assert pf.checkpoints_kept(infinity.Config.from_dict({"checkpoint": {"keep_last": 2}})) == 3  # saves unknown
    assert pf.checkpoints_kept(infinity.Config()) == 1
