"""Module and autograd hooks: when a unit is unsharded, resharded and its gradients reduced.

Per unit module:
  forward pre-hook   -> unshard the unit and wait (compute needs its parameters);
                        a hook on the inputs' gradients reshards it once its
                        backward is over (Note [unit backward done])
  forward hook       -> reshard; if the outputs need gradients, register a
                        pre-backward hook on them (unshard again before the
                        unit's backward runs)
During backward the same module hooks fire again when activation checkpointing
recomputes a unit's forward (Note [recomputed forward]).
Per trainable parameter:
  post-accumulate-grad hook -> when every trainable parameter of the unit has
                        its gradient for this backward, reduce-scatter them.
The hooks only call back into the engine; the callbacks own all state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from infinity.units.unit import Unit


@dataclass
class UnitCallbacks:
    pre_forward: Callable[[Unit], None]
    post_forward: Callable[[Unit], None]
    pre_backward: Callable[[Unit], None]
    grads_ready: Callable[[Unit], None]
    in_backward: Callable[[], bool] = lambda: False  # a backward is running (Note [recomputed forward])
    backward_done: Callable[[Unit], None] = lambda unit: None  # the gradients of the unit's inputs are computed
    pre_recompute: Callable[[Unit], None] | None = None  # before a recomputed forward (None: pre_backward)
    post_recompute: Callable[[Unit], bool] = lambda unit: False  # after it: True if the unit was released
    keep_hook: Callable[[object], None] = lambda handle: None  # a graph hook's handle (Note [graph hooks])


class GraphHooks:
    """The graph hooks of the forward in flight (Note [graph hooks]): removed once its backward is over, when a
    new forward finds no backward pending (the last one's graph was abandoned), and at close (a handle too)."""

    def __init__(self):
        self._handles: list = []

    def keep(self, handle) -> None:
        self._handles.append(handle)

    def forward_begins(self, backward_pending: bool) -> None:
        if not backward_pending:
            self.remove()

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


def tensors_needing_grad(output) -> list[torch.Tensor]:
    flat, _ = tree_flatten(output)
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]


def to_device(tree, device: torch.device, dtype: torch.dtype | None = None):
    """`tree` (tensors in nested lists, tuples, dicts) with every tensor on `device`; the rest as is. With `dtype`
    (the compute dtype: Note [input dtype]) its floating-point tensors are cast to it.

    Inputs from pinned memory are copied asynchronously on the current (compute) stream, which
    is the stream that reads them next.
    """
    def move(x):
        if not isinstance(x, torch.Tensor):
            return x
        to = dtype if dtype is not None and x.is_floating_point() else x.dtype
        return x.to(device, to, non_blocking=True) if x.device != device or x.dtype != to else x
    return tree_map(move, tree)


# Note [input dtype]: the parameters compute in `precision.compute_dtype`; a floating-point input in another dtype
# (fp32 features or embeddings into a bf16 model) failed in the first layer with torch's "mat1 and mat2 must have
# the same dtype". As FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does, `engine(...)` casts every
# floating-point tensor argument to the compute dtype; integer ones (token ids, labels) and the caller's loss on
# the output are untouched.


# Note [plain backward]: `loss.backward()` instead of `engine.backward(loss)` (the mistake docs/loop.md warns of)
# used to run silently and train nothing: no window counted, so step() was a no-op returning False, step after
# step. Every hook that a backward reaches first (a unit's pre-backward, a root parameter's gradient) now refuses
# a backward that is not the engine's, before any gradient is taken into a unit's buffers; the one gradient torch
# had already accumulated on a root parameter is dropped, or the next backward would add to it.
PLAIN_BACKWARD = ("loss.backward() on the output of engine(...): call engine.backward(loss) instead (it scales the "
                  "loss for accumulation and reduces the gradients; this backward trained nothing)")


def pre_backward_hook(callbacks: UnitCallbacks, unit: Unit) -> Callable:
    """The hook on a unit's outputs' gradients: unshard it before its backward (Note [plain backward])."""
    def hook(_grads) -> None:
        if not callbacks.in_backward():
            raise RuntimeError(PLAIN_BACKWARD)
        callbacks.pre_backward(unit)
    return hook


class GradCounter:
    """Counts, per backward, the unit's trainable parameters whose gradient has accumulated."""

    def __init__(self, unit: Unit, grads_ready: Callable[[Unit], None], in_backward: Callable[[], bool]):
        self.unit, self.grads_ready, self.in_backward = unit, grads_ready, in_backward
        self.slot_of = {id(s.param): s for s in unit.slots if s.requires_grad}
        self.expected = len(self.slot_of)
        self.seen: set[int] = set()
        self.fired = False  # grads_ready was called in this backward

    def on_grad(self, param: nn.Parameter) -> None:
        if not self.in_backward():  # Note [plain backward]
            param.grad = None
            raise RuntimeError(PLAIN_BACKWARD)
        self.unit.grads.absorb(self.slot_of[id(param)])
        self.seen.add(id(param))
        if len(self.seen) == self.expected and not self.fired:
            self.fired = True
            self.grads_ready(self.unit)

    def reset(self) -> None:
        """At the end of a backward: parameters that got no gradient start from zero next time."""
        self.seen.clear()
        self.fired = False


def _state_dict_guard(unit: Unit) -> Callable:
    """Note [model state_dict]: between steps a unit's parameters that do not alias a stored tensor (on NVMe, on
    the host beside a GPU, partitioned at stage 3) view a buffer of zero bytes: `torch.save(model.state_dict())`
    wrote storages of no bytes without a word, and the file failed only when loaded. A user's state_dict (not
    keep_vars: the engine reads keys and buffers with keep_vars=True) of such a unit is refused, naming the
    engine's calls; an aliased unit's holds the trained values and is allowed. A user's `model.load_state_dict()`
    is refused for every unit (`_refuse_load`): it reached the compute-dtype parameters only, never the masters."""
    def hook(_module, _prefix, keep_vars) -> None:
        if not keep_vars and not unit.values_readable():
            raise RuntimeError(f"model.state_dict(): the parameters of {unit.name} are held by the engine (sharded "
                               f"or off the device), not in the model: use engine.full_state_dict(), "
                               f"engine.save_checkpoint(path) or engine.export_state_dict(path)")
    return hook


def _refuse_load(*_args) -> None:
    """Note [model state_dict]: a load into the module's parameters would write the compute-dtype values only
    (the engine's fp32 masters and Adam state unchanged: the next step undoes it), or into freed bytes."""
    raise RuntimeError("model.load_state_dict() on a model in an open Engine would not reach its fp32 master "
                       "weights: load weights with infinity.initialize(model, config, weights=PATH) or "
                       "engine.load_checkpoint(path)")


class _ReleaseAtClose:
    """A handle whose remove(), at the engine's close, releases the unit's parameter views (Note [released
    parameters] in units/sharded_param.py)."""

    def __init__(self, unit: Unit):
        self.unit = unit

    def remove(self) -> None:
        self.unit.release_views()


def install_unit_hooks(
    unit: Unit, callbacks: UnitCallbacks, with_module_hooks: bool = True
) -> tuple[list, GradCounter]:
    """Register the hooks of one unit; returns the handles and its gradient counter.

    The root unit gets only gradient hooks: the engine unshards it around the whole
    forward and backward instead.
    """
    # Note [recomputed forward]: activation checkpointing (torch.utils.checkpoint, reentrant or not) runs a
    # unit's forward again inside backward, just before that unit's backward needs its activations. That is
    # not a forward of the step: recording it would append the reverse order to the forward order (which then
    # never replays, so prefetch stops), and resharding after it would free the parameters that the unit's
    # backward is about to read. So inside a backward the hooks are `Recomputation`'s (runtime/recompute.py): for
    # a model that checkpoints its own blocks (Hugging Face's gradient checkpointing) the pre-hook is the unit's
    # pre-backward (unshard, prefetch along the backward order) and the post-hook does nothing: the unit is
    # resharded once its gradients are ready, or at the end of the backward, as without recomputation. The
    # engine's `[activation] checkpoint` runs inside these hooks, so its recomputation fires none of them (Note
    # [unit checkpoints]), except in a block split into tiles and checkpointed whole (Note [tiles are units] in
    # units/tiling.py): there the pre-hook waits for the tile with no prefetch, and a tile the recomputation
    # itself had to fetch is released after its recomputed forward (its backward fetches it again), so a
    # recomputation holds one tile at a time, not the block.
    # Note [unit backward done]: a unit whose parameters are not all trainable (LoRA, frozen layers) gets no
    # "all gradients taken" signal that its backward is over, since frozen weights have no gradient: it used
    # to stay unsharded until the whole backward ended, so fine-tuning with parameters on NVMe held every
    # block's parameters at once (a 1.54B LoRA run peaked at 7.4 GiB). Once autograd has computed the
    # gradients of the unit's inputs, every node of the unit's backward that reads its weights on the way to
    # them has run: the unit reshards then. (A unit used twice in one forward is unsharded again by the
    # pre-backward hook of its earlier call.) Inputs that need no gradient leave it to the end of backward.
    # Note [graph hooks]: torch's register_multi_grad_hook(mode="all") closes over the tensors' grad_fns, and the
    # graph stores the hook on those nodes in C++: a cycle Python's collector cannot see, which kept the nodes
    # and, through the callback, the engine and all its device state alive after close (a second engine in one
    # process ran out of memory on an H100). Every graph hook's handle goes to `callbacks.keep_hook`; the engine
    # removes them once the backward is over, when a forward's graph is abandoned, and at close. (The graph of a
    # forward whose result is dropped without a backward is freed with it: Note [saved alias] in activations.py.)
    handles = []
    for module in unit.modules if with_module_hooks else ():
        def pre(_module, args, u=unit):
            if callbacks.in_backward():
                (callbacks.pre_recompute or callbacks.pre_backward)(u)
                return None
            callbacks.pre_forward(u)
            inputs = tensors_needing_grad(args)
            if inputs:  # Note [unit backward done]
                callbacks.keep_hook(register_multi_grad_hook(
                    inputs, lambda _grads, uu=u: callbacks.backward_done(uu), mode="all"))
            return None

        handles.append(module.register_forward_pre_hook(pre))

        def post(_module, _args, output, u=unit):
            if callbacks.in_backward():  # a recomputed forward (Note [recomputed forward])
                if callbacks.post_recompute(u):  # released: fetched again before its backward (reentrant: on
                    needing = tensors_needing_grad(output)  # these outputs; non-reentrant: the forward's)
                    if needing:
                        callbacks.keep_hook(register_multi_grad_hook(needing, pre_backward_hook(callbacks, u),
                                                                     mode="any"))
                return None
            callbacks.post_forward(u)
            needing = tensors_needing_grad(output)
            if needing:
                callbacks.keep_hook(register_multi_grad_hook(needing, pre_backward_hook(callbacks, u), mode="any"))
            return None

        handles.append(module.register_forward_hook(post))
    handles.append(_ReleaseAtClose(unit))
    owners = {id(module): module for slot in unit.slots for module, _attr in slot.owners}
    handles += [module.register_state_dict_pre_hook(_state_dict_guard(unit)) for module in owners.values()]
    handles += [module.register_load_state_dict_pre_hook(_refuse_load) for module in owners.values()]
    counter = GradCounter(unit, callbacks.grads_ready, callbacks.in_backward)
    for p in unit.trainable_params():
        handles.append(p.register_post_accumulate_grad_hook(counter.on_grad))
    return handles, counter
