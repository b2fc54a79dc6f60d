"""The update mode: when an accumulation window's optimizer update runs, relative to the training thread. The one
place it is chosen, from the configuration alone, with the predicates the choice is made of; the modes themselves
(one type each) are in runtime/update_modes.py (Note [overlap]), the planner reads the choice too (the journal's
room, the tail units' share, the device lane: memory/placement.py).

Not from the plan: every rank must run the same mode (their collectives), while the journal's bytes may differ
between ranks (free host memory); a journal with no room defers every unit.

Note [speculation default]: only a size in `overlap.speculation` speculates (every window); "auto" waits for the
norm (the deferred update), as measured on both machines the copies had to share:
- on an H100 (bench_gpu, 2026-11-26, the ZeRO-Offload shape) speculating with a clip that never fired cost
  2.51x the unclipped step for the fp32 GPT 1.31B (case b) and 2.11x for the 1.12B Llama in bf16, against
  1.31x and 1.11x for waiting with the clip firing in every window. The CPU's Adam is already the busy resource
  during backward there (0.24-0.30 s of it against ~0.26 s of backward), and the copies (16 bytes per element
  in, as many back) double its memory traffic; a fired clip paid the redo on top (2.76x);
- on the 2-core development machine the copies took the cores from compute: 1.33-1.56x the deferred step with
  a clip that never fired, 1.33-1.65x with one that always did (docs/tiers.md).
The forecast that speculated only after 4 windows without a fired clip is gone with it: it avoided the redo,
not the copies. What would make speculation pay: no copies, the speculated update writing its results beside
the state it read (then committing them is a swap of the unit's storage, and a redo reads the untouched state).
torch's fused Adam kernels update in place, so that needs a kernel with separate outputs.
"""

from __future__ import annotations

import enum

from infinity.config.sections import Config


class Mode(enum.Enum):
    INLINE = "inline"  # on the training thread, inside step() (no [overlap] optimizer_with_backward)
    EAGER = "eager"  # on the worker, each unit as soon as its gradients are final, during backward
    SPECULATIVE = "speculative"  # as eager, as if the clip will not fire; redone from a journal if it does
    DEFERRED = "deferred"  # on the worker after the global norm, in the next forward's order


def needs_norm(config: Config) -> bool:
    """Does a unit's update depend on the global gradient norm (clipping, fp16 loss scaling, skipping non-finite
    steps)? Then it cannot start from its own gradients alone (Note [overlap])."""
    return (config.optimizer.grad_clip > 0 or config.precision.compute_dtype == "fp16"
            or config.train.on_nonfinite != "error")


def update_mode(config: Config) -> Mode:
    """The mode `config` runs (Note [overlap]). A norm-dependent update is speculated only with a size in
    `overlap.speculation` and no fp16 loss scale governing it (Note [speculative update], Note [speculation
    default]: "auto" and 0 wait for the norm)."""
    if not config.overlap.optimizer_with_backward:
        return Mode.INLINE
    if not needs_norm(config):
        return Mode.EAGER
    if config.precision.compute_dtype != "fp16" and config.overlap.speculation not in (0, "auto"):
        return Mode.SPECULATIVE
    return Mode.DEFERRED
