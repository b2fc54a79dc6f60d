"""Forwards without a backward that do not come through `engine(batch)`: the user's own `engine.module(x)`
under `torch.no_grad()` (evaluation), and `engine.generate(...)` (a Hugging Face model's own generation loop,
one forward per new token, with its KV cache).

Note [inference forwards]: `engine(batch)` unshards the root unit around the model's forward by hand: the root
holds what is outside the blocks or shared between them (embeddings, the head, final norms), and has no module
hooks of its own. A forward that does not come through `engine(batch)` used to find the root's parameters
resharded: zero bytes, so with parameters on NVMe the embedding failed ("setStorage: ... out of bounds for
storage of size 0"); on the host and device tiers the root aliases its stored shard and it worked by chance.
A forward pre-hook and a forward hook on the whole model (and on the model a PEFT wrapper's `generate` calls)
now do for such a forward what `engine(batch)` does: wait for the root's update and unshard it, start the
prefetch of the first blocks (the block hooks prefetch the rest, as in training), then release what was
prefetched and not used and reshard the root. Only the outermost of nested calls does it (a PEFT wrapper's
forward calls its base model's). Inside `engine.generate` the root stays unsharded from the first forward to
the last: one fetch of the embeddings and head per generate, not one per token. Such forwards must not need
gradients (a backward follows only `engine(batch)`), so they allocate no gradient state and leave the
training that follows exactly as if they had not run.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
from torch import nn

from infinity.runtime.compiled import refuse_compiled
from infinity.runtime.hooks import tensors_needing_grad, to_device
from infinity.runtime.prefetch import Prefetcher
from infinity.units.sharded_param import RELEASED
from infinity.units.unit import Unit

# Note [one engine per model]: a second `infinity.initialize` of a model whose engine is still open (a notebook
# cell run again) used to be accepted: it sharded the model again under the first engine's hooks, and both
# engines then failed at their first forward with a message about `engine.module(...)`. The hooks on the whole
# model claim it for the engine's life; `initialize` refuses a claimed model, naming close(), and a closed one
# whose parameters its engine released (Note [released parameters] in units/sharded_param.py).
_CLAIMED: weakref.WeakSet = weakref.WeakSet()  # the models of open engines


def unclaimed(model: nn.Module) -> nn.Module:
    """`model`, if no open engine holds it (Note [one engine per model]) and it is not compiled whole (Note
    [compiled units])."""
    refuse_compiled(model)
    if model in _CLAIMED:
        raise RuntimeError("this model is already in an open Engine (an earlier infinity.initialize): call close() "
                           "on that engine first, or initialize a new model")
    if any(RELEASED.get(id(p)) is p for p in model.parameters()):
        raise RuntimeError("this model's engine was closed and released its parameters (stored on NVMe or "
                           "partitioned, not in the model): build the model again (infinity.meta_init) and load the "
                           "weights (initialize(..., weights=) from an export, or engine.load_checkpoint)")
    return model


class _Claim:
    """A handle whose remove() (at the engine's close) releases the model (Note [one engine per model])."""

    def __init__(self, model: nn.Module):
        _CLAIMED.add(model)
        self._model = weakref.ref(model)

    def remove(self) -> None:
        if (model := self._model()) is not None:
            _CLAIMED.discard(model)


class InferenceForwards:
    """The root unit's unshard around forwards of the model made outside `engine(batch)`."""

    def __init__(self, module: nn.Module, root: Unit, pre_forward: Callable[[Unit], None], prefetcher: Prefetcher,
                 device: torch.device, backward_pending: Callable[[], bool]):
        self.module, self.root, self.prefetcher, self.device = module, root, prefetcher, device
        self._pre_forward, self._backward_pending = pre_forward, backward_pending
        self._engine_call = False  # engine(batch) is running its own forward: these hooks stand aside
        self._holding = False  # inside generate: the root stays unsharded between forwards
        self._depth = 0  # nested forwards of the hooked modules (a PEFT wrapper around its base model)
        self.handles = [_Claim(module)]
        for m in _generating_modules(module):
            self.handles += [m.register_forward_pre_hook(self._before),
                             m.register_forward_hook(self._after, always_call=True)]  # (after an error too)

    @contextlib.contextmanager
    def engine_call(self):
        """Around `engine(batch)`'s own forward, which unshards the root itself."""
        self._engine_call = True
        try:
            yield
        finally:
            self._engine_call = False

    def _before(self, _module, _args) -> None:
        if self._engine_call:
            return None
        if self._depth == 0 and self._backward_pending():
            raise RuntimeError("a forward through engine.module(...) (evaluation, generate) between engine(batch) "
                               "and its engine.backward(loss) would release what that backward needs: call "
                               "engine.backward(loss) first")
        self._depth += 1
        if self._depth == 1:
            self._pre_forward(self.root)  # (waits for the root's update, starts the first blocks' prefetch)
        return None

    def _after(self, _module, _args, output) -> None:
        if self._engine_call or self._depth == 0:  # (the pre-hook refused this forward)
            return None
        self._depth -= 1
        if self._depth:
            return None
        self.prefetcher.end_forward(backward_follows=False)
        self.prefetcher.release_unused()
        if not self._holding:
            self.root.reshard()
        if tensors_needing_grad(output):
            raise RuntimeError("a forward through engine.module(...) outside engine(batch) needs gradients, but "
                               "only engine(batch) is followed by engine.backward: call engine(batch) to train, "
                               "or wrap evaluation in torch.no_grad()")
        return None

    def generate(self, *args, **kwargs):
        """The model's own `generate`, under no_grad, with the root unsharded throughout."""
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise TypeError(f"engine.generate delegates to the model's own generate(), and "
                            f"{type(self.module).__name__} has none: use a Hugging Face model (or a PEFT model "
                            f"wrapping one), or write the sampling loop with engine(input_ids) under "
                            f"torch.no_grad()")
        args, kwargs = to_device((args, kwargs), self.device)
        self._holding = True
        try:
            with torch.no_grad():
                return generate(*args, **kwargs)
        finally:
            self._holding = False
            self._depth = 0
            self.prefetcher.release_unused()
            self.root.reshard()


def _generating_modules(module: nn.Module) -> list[nn.Module]:
    """The model, and the model a wrapper's `generate` runs when it is another one (PEFT's base model)."""
    modules = [module]
    base = getattr(module, "get_base_model", None)
    inner = base() if callable(base) else None
    if isinstance(inner, nn.Module) and inner is not module:
        modules.append(inner)
    return modules
