"""Compiled units: `[compile] units = true` compiles each unit module's forward; a model compiled whole is refused.

    refuse_compiled(model)      # initialize's first check (inference.unclaimed): torch.compile(model), .compile()
    handles = compile_units(config.compile, units)   # Activations.install, before its checkpoints wrap them

Note [compiled units]: the engine drives a step through hooks at every unit's boundary (unshard before its
forward, reshard after, a hook on its outputs' gradients, saved-tensor hooks that count and offload activations),
and each of them reads or moves state: host code that no graph can hold. Around a model compiled whole
(`torch.compile(model)`, `model.compile()`), dynamo breaks its graph at every hook and traces the hooks themselves
as they run (the saved-tensor hooks once per tensor kind, up to its recompile limit, then falls back to eager):
on a tiny GPT, 26 s for 10 micro-steps against 1.3 s eager (2026-11-28), so `initialize` refuses such a model and
names the fix. With `units = true` the engine compiles the units' own forwards instead, as activation checkpoints
wrap them (Note [unit checkpoints] in activations.py): `module.forward` becomes `torch.compile(forward)`, the one
attribute set on the module (removed at close), so the module's hooks run outside the compiled code, and the
checkpoint and its offload hooks, installed after, wrap the compiled forward (the recomputation replays it). The
parameters enter the graph as inputs (dynamo inlines the module), so units of one class (a model's blocks) share
one graph and are compiled once; a unit's gathered parameters live at new addresses each step, which a graph
without CUDA graphs does not mind (compile.mode refuses the CUDA graph modes). The root unit's code (embedding,
head, loss: the model's own forward, which calls the units) stays eager, and so does a block split into tiles:
its tile units are compiled one by one. Compiled and eager runs agree within float tolerance, not bit for bit
(fused kernels round differently): tests/runtime/test_compile.py.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from infinity.config.options import ConfigError
from infinity.units.unit import Unit

FIX = ("pass the model itself (for torch.compile(model): its ._orig_mod) and set [compile] units = true: each "
       "unit's forward is compiled, the engine's hooks outside (docs/compile.md)")


def refuse_compiled(model: nn.Module) -> None:
    """A model compiled whole, or any module of it compiled with its hooks inside, is refused (Note [compiled
    units]): one line naming the module and the fix."""
    if "torch._dynamo" not in sys.modules:
        return  # nothing was compiled in this process (and its import costs ~1 s of every initialize)
    from torch._dynamo.eval_frame import OptimizedModule
    for name, module in model.named_modules():
        what = ("torch.compile(model)" if isinstance(module, OptimizedModule) and not name else
                f"{name} is torch.compile(...)" if isinstance(module, OptimizedModule) else
                f"{name or 'the model'}.compile() was called" if getattr(module, "_compiled_call_impl", None) else "")
        if what:
            raise ConfigError(f"infinity.initialize got a compiled model ({what}): a graph around the engine's unit "
                              f"hooks breaks at each of them and recompiles, slower than eager; {FIX}")


class _RestoreForward:
    """Handle: removes the compiled forward from a module (the class's forward applies again)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def compile_units(config, units: list[Unit]) -> list:
    """`[compile]`: every unit module's forward but the root's compiled (Note [compiled units]); the handles that
    restore them."""
    if not config.units:
        return []
    options = {"backend": config.backend, "fullgraph": config.fullgraph}
    if config.backend == "inductor":
        options["mode"] = config.mode
    handles = []
    for unit in units[1:]:
        for module in unit.modules:
            module.forward = torch.compile(module.forward, **options)
            handles.append(_RestoreForward(module))
    return handles
