"""benchmarks/bench_offload_bound.py's choice of m2's shape: the largest of its width whose fp32 training state is
at least 1.2x the GPU's memory and that the estimator says fits; none when no layer count is both."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_offload_bound as bench  # noqa: E402

H200 = 141 << 30


def params(rung) -> int:
    """A Llama's parameters by formula (an independent count): embeddings and head, and per block the attention's
    four projections (k and v at the key-value heads' width), the three MLP projections and two norms."""
    head = rung.d_model // rung.n_head
    attention = 2 * rung.d_model * rung.d_model + 2 * rung.d_model * rung.n_kv_head * head
    block = attention + 3 * rung.d_model * rung.ffn_dim + 2 * rung.d_model
    return 2 * rung.vocab_size * rung.d_model + rung.n_layer * block + rung.d_model


@pytest.mark.parametrize("fits_up_to", [38])
def test_m2_takes_the_largest_shape_that_fits_and_is_over_the_gpu(monkeypatch, fits_up_to):
    monkeypatch.setattr(bench, "estimate_fits", lambda rung, args, nvme_dir: 1 << 30 if rung.n_layer <= fits_up_to
                        else None)
    args = argparse.Namespace(tiny=False, seq=1024)
    rung, judged, acts = bench.m2_shape(H200, args, "/tmp")
    assert acts == 1 << 30  # (the activations the estimate left free, for the engine's memory.activation_reserve)
    assert rung.d_model == 5120 and rung.n_layer == fits_up_to  # (the 13B's width on a 141 GB GPU)
    assert params(rung) * bench.STATE_BYTES >= 1.2 * H200
    assert len(judged) == 40 - fits_up_to + 1 and judged[-1].endswith("fits")


def test_m2_refuses_when_what_fits_is_not_over_the_gpu(monkeypatch):
    monkeypatch.setattr(bench, "estimate_fits", lambda rung, args, nvme_dir: 1 if rung.n_layer <= 20 else None)
    with pytest.raises(RuntimeError, match="no shape of m2's width is both over 1.2x"):
        bench.m2_shape(H200, argparse.Namespace(tiny=False, seq=1024), "/tmp")
    small = bench.m2_base(80 << 30, tiny=False)
    assert small.d_model == 4096  # an H100: the 7B's width
