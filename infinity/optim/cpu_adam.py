"""Adam / AdamW on flat fp32 shards, with torch's fused kernel for the shards' device.

`adam_step` is the fast path (``torch._fused_adam_`` / ``torch._fused_adamw_``:
on CPU shards the vectorized, parallel CPU kernel; on CUDA shards the fused CUDA
kernel, so a device-tier optimizer steps on the GPU). `adam_step_reference` is the same
update in plain torch ops, written to be read; the parity tests hold the two
against each other and against ``torch.optim.Adam`` / ``torch.optim.AdamW``.

Note [grad is unscaled in place]: with ``grad_scale`` set, the fused kernel
divides ``grad`` by it *in place* (it writes the unscaled gradient back) before
using it. The reference does the same, so after either call ``grad`` holds
``grad / grad_scale``. Callers that need the scaled gradient afterwards must
copy it first. Weight decay is never written back into ``grad``.

Note [step is passed, not counted]: the kernel reads the step count for
bias correction and does not increment it (torch.optim increments its
``state_steps`` before calling). Callers own the count and pass the 1-based
number of the update being made.

Note [sub-groups]: the update is elementwise, so stepping a flat shard in
slices (one sub-group at a time, as the NVMe pipeline streams them) gives the
same result as stepping it whole. Bit for bit only when every slice boundary
is a multiple of 64 elements: the kernel handles the last ``numel % width``
elements of each call with scalar code, which rounds differently from its
SIMD lanes (about 1 ulp). Elsewhere the difference stays within fp32
tolerance. Tests check both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["AdamHyper", "Hypers", "adam_step", "adam_step_reference"]


@dataclass(frozen=True, kw_only=True)
class AdamHyper:
    """Hyperparameters of one Adam update."""

    lr: float
    """Learning rate of this step (after the schedule)."""
    beta1: float
    """Decay rate of the first moment (exp_avg)."""
    beta2: float
    """Decay rate of the second moment (exp_avg_sq)."""
    eps: float
    """Added to sqrt(v_hat) in the denominator."""
    weight_decay: float
    """Decoupled (AdamW) or L2-in-the-gradient (Adam) weight decay."""
    decoupled: bool
    """True: AdamW (``master *= 1 - lr * weight_decay``); False: Adam (``grad += weight_decay * master``)."""


Hypers = tuple[AdamHyper, ...]  # one per parameter group (Note [groups ride on ranges] in groups.py)


def _check_shards(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  step: int, grad_scale: float | None) -> None:
    """Internal invariants of the caller (raised even under ``python -O``)."""
    numel = master.numel()
    for name, t in (("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not (t.dtype == torch.float32 and t.device == master.device and t.dim() == 1 and t.is_contiguous()
                and t.numel() == numel):
            raise AssertionError(
                f"adam_step: {name} must be a flat contiguous fp32 tensor of {numel} elements on {master.device} "
                f"(as master); "
                f"got dtype={t.dtype} device={t.device} shape={tuple(t.shape)} stride={t.stride()} "
                f"contiguous={t.is_contiguous()}"
            )
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise AssertionError(f"adam_step: step must be the 1-based count of this update (int >= 1), got {step!r}")
    if grad_scale is not None and not (math.isfinite(grad_scale) and grad_scale > 0):
        raise AssertionError(f"adam_step: grad_scale must be finite and > 0, got {grad_scale!r}")


def adam_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, hyper: AdamHyper, grad_scale: float | None = None) -> None:
    """One Adam / AdamW update, in place on flat contiguous fp32 tensors on one device (CPU or CUDA).

    ``step`` is the 1-based count of this update (bias correction uses it).
    ``grad_scale``: the kernel uses ``grad / grad_scale`` (fold in the fp16 loss
    scale and the clipping coefficient as ``grad_scale = loss_scale / clip_coef``);
    ``grad`` is left holding that unscaled gradient (Note [grad is unscaled in place]).
    """
    _check_shards(master, grad, exp_avg, exp_avg_sq, step, grad_scale)
    kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    device = master.device  # the kernel's scalars live with its shards (torch.full: no host-to-device copy)
    kernel(
        [master], [grad], [exp_avg], [exp_avg_sq], [],
        [torch.full((), float(step), device=device)],  # read, not incremented (Note [step is passed, not counted])
        lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps,
        amsgrad=False, maximize=False,
        grad_scale=None if grad_scale is None else torch.full((), grad_scale, dtype=torch.float32, device=device),
        found_inf=None,
    )


def adam_step_reference(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor, *, step: int, hyper: AdamHyper,
                        grad_scale: float | None = None) -> None:
    """The same update as `adam_step`, in plain torch ops (as torch.optim's single-tensor Adam)."""
    _check_shards(master, grad, exp_avg, exp_avg_sq, step, grad_scale)
    if grad_scale is not None:
        grad.div_(grad_scale)  # in place, as the fused kernel does
    g = grad
    if hyper.weight_decay != 0.0:
        if hyper.decoupled:
            master.mul_(1.0 - hyper.lr * hyper.weight_decay)
        else:
            g = g + hyper.weight_decay * master  # L2: a new tensor, grad itself is not changed
    exp_avg.lerp_(g, 1.0 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
    bias_correction1 = 1.0 - hyper.beta1**step
    bias_correction2 = 1.0 - hyper.beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(hyper.eps)
    master.addcdiv_(exp_avg, denom, value=-hyper.lr / bias_correction1)
