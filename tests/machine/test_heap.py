"""Note [heap release]: `[memory] release_heap` gives the C heap's free pages back once per step."""

from __future__ import annotations

import subprocess
import sys

import pytest

import infinity
from infinity.config.sections import ConfigError
from infinity.machine import heap

# A fresh process fragments its heap the way training does: freeing one large (mmapped) tensor raises
# glibc's mmap threshold, so the next 1 MiB tensors come from the heap; all but the last (which pins the
# heap's top, so freeing cannot simply shrink it) are freed. Prints RSS in MiB before and after release().
FRAGMENT = """
import psutil, torch
from infinity.machine.heap import heap_policy
policy = heap_policy({release})
big = torch.ones(24 * 2**20 // 4); del big
chunks = [torch.ones(2**20 // 4) for _ in range(150)]
last = chunks.pop()
del chunks
rss = lambda: psutil.Process().memory_info().rss >> 20
before = rss()
policy.release()
print(before, rss())
"""


def rss_around_release(release: bool) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", FRAGMENT.format(release=release)], capture_output=True, text=True,
                         check=True)
    before, after = map(int, out.stdout.split())
    return before, after


@pytest.mark.skipif(heap._malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_release_gives_the_freed_heap_pages_back_and_keep_does_not():
    kept = rss_around_release(False)
    assert kept[0] - kept[1] < 20, kept  # the ~150 MiB of freed tensors stay resident
    trimmed = rss_around_release(True)
    assert trimmed[0] - trimmed[1] > 100, trimmed


@pytest.mark.skipif(heap._malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_the_engine_releases_once_per_optimizer_step(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(heap.TrimHeap, "release", lambda self: calls.append(1))
    model = torch_model()
    config = infinity.Config.from_dict({"memory": {"release_heap": True}, "train": {"grad_accum_steps": 2}})
    engine = infinity.initialize(model, config)
    try:
        for _ in range(3):
            for _ in range(2):
                engine.backward(engine(*batch()).sum())
            engine.step()
    finally:
        engine.close()
    assert len(calls) == 3


def test_default_engine_keeps_the_heap_and_a_libc_without_trim_is_refused(monkeypatch):
    assert isinstance(heap.heap_policy(infinity.Config().memory.release_heap), heap.KeepHeap)
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    with pytest.raises(ConfigError, match="set memory.release_heap = false"):
        heap.heap_policy(True)


def torch_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def batch():
    import torch
    return (torch.randn(4, 8),)
