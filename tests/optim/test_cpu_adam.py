"""Parity of the CPU Adam kernels with torch.optim, and the learning-rate schedule."""

import math

import pytest
import torch

from infinity.config.sections import OptimizerConfig
from infinity.optim import AdamHyper, adam_step, adam_step_reference, lr_at

SHAPES = [(37, 19), (64,), (5, 3, 7), (1,)]  # odd sizes: exercise the kernel's vector tails
LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


@pytest.mark.parametrize("kernel", [adam_step, adam_step_reference], ids=["fused", "reference"])
@pytest.mark.parametrize("max_norm", [None, 0.5, 1e6], ids=["no_clip", "clip", "clip_inactive"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_matches_torch_optim(kernel, max_norm, decoupled):
    weight_decay = 0.1
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]
    optim_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = optim_cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay)

    master = torch.cat([p.detach().flatten() for p in params])
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    hyper = AdamHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=weight_decay, decoupled=decoupled)

    for step in range(1, 6):
        grads = _grads(step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        grad_scale = None
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)  # grads *= min(max_norm / (norm + 1e-6), 1)
            total_norm = torch.cat([g.flatten() for g in grads]).norm().item()
            grad_scale = 1.0 / min(max_norm / (total_norm + 1e-6), 1.0)
        opt.step()

        grad = torch.cat([g.flatten() for g in grads])
        kernel(master, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper, grad_scale=grad_scale)

        torch.testing.assert_close(master, torch.cat([p.detach().flatten() for p in params]))
        torch.testing.assert_close(exp_avg, torch.cat([opt.state[p]["exp_avg"].flatten() for p in params]))
        torch.testing.assert_close(exp_avg_sq, torch.cat([opt.state[p]["exp_avg_sq"].flatten() for p in params]))


def _state(numel: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    master, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    return master, grad, torch.randn(numel, generator=gen) * 0.1, torch.rand(numel, generator=gen) * 0.01


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_scale", [None, 3.0])
def test_fused_matches_reference_and_unscales_grad_in_place(decoupled, grad_scale):
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, decoupled=decoupled)
    fused, reference = _state(10_007, seed=1), _state(10_007, seed=1)
    original_grad = fused[1].clone()
    adam_step(*fused, step=7, hyper=hyper, grad_scale=grad_scale)
    adam_step_reference(*reference, step=7, hyper=hyper, grad_scale=grad_scale)
    for got, want in zip(fused, reference):
        torch.testing.assert_close(got, want)
    # Note [grad is unscaled in place]: grad now holds grad / grad_scale; weight decay is not written into it.
    torch.testing.assert_close(fused[1], original_grad / (grad_scale or 1.0))


@pytest.mark.parametrize("kernel", [adam_step, adam_step_reference], ids=["fused", "reference"])
@pytest.mark.parametrize("cut, exact", [(1024, True), (1031, False)], ids=["aligned", "unaligned"])
def test_chunked_equals_whole(kernel, cut, exact):
    """Stepping a flat shard one sub-group at a time equals stepping it whole (Note [sub-groups]).

    Bit-exact when the cut is a multiple of 64 elements; otherwise within fp32 tolerance.
    """
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True)
    whole, chunked = _state(4099, seed=2), _state(4099, seed=2)
    for step in (1, 2, 3):
        kernel(*whole, step=step, hyper=hyper, grad_scale=2.0)
        for lo, hi in ((0, cut), (cut, 4099)):  # views into the same storage
            kernel(*(t[lo:hi] for t in chunked), step=step, hyper=hyper, grad_scale=2.0)
    tolerance = {"rtol": 0, "atol": 0} if exact else {}
    for got, want in zip(chunked, whole):
        torch.testing.assert_close(got, want, **tolerance)


HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, decoupled=True)


@pytest.mark.parametrize("kernel", [adam_step, adam_step_reference], ids=["fused", "reference"])
@pytest.mark.parametrize(
    "bad, kwargs, match",
    [
        ({"master": torch.zeros(20)[::2]}, {}, r"master .*stride=\(2,\) contiguous=False"),
        ({"grad": torch.zeros(10, dtype=torch.bfloat16)}, {}, r"grad .*dtype=torch.bfloat16"),
        ({"exp_avg": torch.zeros(11)}, {}, r"exp_avg .*10 elements.*shape=\(11,\)"),
        ({"exp_avg_sq": torch.zeros(2, 5)}, {}, r"exp_avg_sq .*shape=\(2, 5\)"),
        ({}, {"step": 0}, r"step must be .* got 0"),
        ({}, {"grad_scale": float("inf")}, r"grad_scale must be finite and > 0, got inf"),
    ],
)
def test_bad_inputs_assert_with_values(kernel, bad, kwargs, match):
    tensors = {"master": torch.zeros(10), "grad": torch.zeros(10), "exp_avg": torch.zeros(10),
               "exp_avg_sq": torch.zeros(10), **bad}
    with pytest.raises(AssertionError, match=match):
        kernel(**tensors, **{"step": 1, "hyper": HYPER, **kwargs})


# ---------------------------------------------------------------- schedule

def _cfg(**kw) -> OptimizerConfig:
    return OptimizerConfig(lr=1.0, **kw)


def test_constant_with_warmup():
    cfg = _cfg(warmup_steps=4)
    assert [lr_at(s, cfg) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert lr_at(0, _cfg()) == 1.0


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_matches_formula(schedule):
    warmup, total, min_ratio = 10, 110, 0.1
    cfg = _cfg(schedule=schedule, warmup_steps=warmup, total_steps=total, min_lr_ratio=min_ratio)
    for step in range(0, 130):
        if step < warmup:
            want = (step + 1) / warmup
        elif step >= total:
            want = min_ratio
        else:
            progress = (step - warmup) / (total - warmup)
            decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
            want = min_ratio + (1 - min_ratio) * decay
        assert lr_at(step, cfg) == pytest.approx(want, rel=1e-12), step
    assert lr_at(warmup, cfg) == pytest.approx(1.0)
    assert lr_at(total, cfg) == pytest.approx(min_ratio)


def test_lr_at_rejects_negative_step():
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        lr_at(-1, _cfg())


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_adam_step_runs_on_the_shards_device(decoupled, monkeypatch):
    """A device-tier optimizer steps where its state lives (issue 21: adam_step used to assert CPU tensors,
    so the device tier's optimizer crashed on CUDA). Shown on CPU with shards on the meta device: the kernel
    for the shards' device is called with its scalars on that device, never a CPU-only path."""
    seen = {}
    real = torch._fused_adamw_ if decoupled else torch._fused_adam_

    def spy(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **kw):
        seen["devices"] = {t.device.type for t in (*params, *grads, *exp_avgs, *exp_avg_sqs, *state_steps)}
        seen["grad_scale"] = kw["grad_scale"].device.type
        return real(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **kw)

    monkeypatch.setattr(torch, "_fused_adamw_" if decoupled else "_fused_adam_", spy)
    hyper = AdamHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1, decoupled=decoupled)
    shards = [torch.empty(100, device="meta") for _ in range(4)]
    adam_step(*shards, step=3, hyper=hyper, grad_scale=2.0)
    assert seen == {"devices": {"meta"}, "grad_scale": "meta"}
    with pytest.raises(AssertionError, match="on meta"):  # mixed devices stay an internal error
        adam_step(shards[0], torch.zeros(100), shards[2], shards[3], step=3, hyper=hyper)


@pytest.mark.gpu
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_adam_step_on_cuda_matches_torch_fused(decoupled):
    """The device tier's update on CUDA is torch's fused CUDA kernel: equal to torch.optim's fused step there."""
    gen = torch.Generator().manual_seed(5)
    param = torch.nn.Parameter(torch.randn(1000, generator=gen).cuda())
    optim_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = optim_cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1, fused=True)
    master = param.detach().clone()
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    hyper = AdamHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1, decoupled=decoupled)
    for step in range(1, 4):
        grad = torch.randn(1000, generator=gen).cuda()
        param.grad = grad.clone()
        opt.step()
        adam_step(master, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper)
        torch.testing.assert_close(master, param.detach())
