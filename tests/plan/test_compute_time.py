"""Note [compute time] (memory/cost_model.py): the trace's work (FLOPs of the operations with a FLOP formula, bytes
the others read and write, operations run) against counts made by hand, and its price at the rates by the Note's
formulas, on a CPU and on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from infinity.memory.cost_model import MATMUL_EFFICIENCY, LinkRates, Work, compute_seconds
from infinity.plan.traced import FlopCount


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_count_takes_the_matmuls_flops_the_others_bytes_and_every_operation(device):
    """x @ w, relu, a view, a sum: the matmul's 2 m n k FLOPs; relu's input and result (8 x 4 fp32 each) and the
    sum's input and result as bytes; the views (autograd's detach of relu's saved result, .view) move none; five
    operations. Planted: a view's bytes counted, fails (388 + 256)."""
    x = torch.ones(8, 16, device=device, requires_grad=True)
    w = torch.ones(16, 4, device=device, requires_grad=True)
    with FlopCount() as count:
        y = torch.relu(x @ w).view(32).sum()
    assert count.work() == Work(flops=2 * 8 * 16 * 4, bytes=2 * 8 * 4 * 4 + (8 * 4 * 4 + 4), ops=5)
    with FlopCount() as count:
        y.backward()
    assert count.total == 2 * (2 * 8 * 16 * 4)  # (the two matmuls of mm's backward)
    assert count.ops > 5 and count.bytes > 0


def test_on_a_cpu_the_three_add_up_and_on_a_gpu_the_host_runs_beside_the_kernels():
    cpu = LinkRates(nvme_read=1e9, nvme_write=1e9, cpu_adam=1e9, device_adam=1e9, matmul_flops=1e11, memory_bw=1e10,
                    op_seconds=1e-5)
    gpu = LinkRates(nvme_read=1e9, nvme_write=1e9, h2d=5e10, d2h=5e10, cpu_adam=1e9, device_adam=1e11,
                    matmul_flops=1e15, memory_bw=4e12, op_seconds=1e-5)
    work = Work(flops=2e10, bytes=1e9, ops=1000)
    assert compute_seconds(work, cpu) == pytest.approx(2e10 / (1e11 * MATMUL_EFFICIENCY["cpu"]) + 0.1 + 0.01)
    kernels = 2e10 / (1e15 * MATMUL_EFFICIENCY["gpu"]) + 1e9 / 4e12
    assert compute_seconds(work, gpu) == pytest.approx(max(kernels, 0.01)) == pytest.approx(0.01)  # (launch-bound)
    assert compute_seconds(work.per_batch(1000), gpu) == pytest.approx(1000 * kernels)  # (kernel-bound)
    unpriced = LinkRates(nvme_read=1e9, nvme_write=1e9, cpu_adam=1e9, device_adam=1e9, matmul_flops=1e11)
    assert math.isinf(unpriced.memory_bw) and compute_seconds(work, unpriced) == pytest.approx(0.2)


def test_a_larger_micro_batch_scales_the_flops_and_bytes_not_the_operations():
    work = Work(flops=10.0, bytes=20.0, ops=30.0)
    assert work.per_batch(2.0) == Work(20.0, 40.0, 30.0) and work.times(2) == Work(20.0, 40.0, 60.0)
    assert work + work == work.times(2)
