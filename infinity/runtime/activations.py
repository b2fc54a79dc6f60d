"""Activations: what the forward keeps for backward, counted; unit checkpoints; their inputs on the host.

    acts = activations_for(config, units, streams, device)  # config: the engine's ([activation], [compile])
    handles = acts.install()                 # wraps each unit module's forward (not the root's)
    with acts.forward():                     # the engine's forward: counts the saved bytes
        output = model(batch)
    acts.fetch([i])                          # issue: bring unit i's offloaded inputs back (the prefetcher)
    acts.report()                            # activation_saved_bytes, activation_host_bytes, ...

Note [unit checkpoints]: with `[activation] checkpoint = "units"` each unit module's forward runs inside
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the forward keeps only the unit's inputs and
its backward recomputes the forward first. The engine applies it by replacing the module's `forward` (the
one attribute it sets on a model's module; `remove()` at close deletes it), so the model is not changed and
the module's hooks stay outside the checkpoint: they fire once per real forward, and the recomputation,
which calls the original forward, fires none of them. Its parameters are already there: the unit's
pre-backward hook (on its outputs' gradients) runs before the first backward op of the unit, which is what
triggers the recomputation, and the prefetcher issued that unshard one unit ahead in backward order. So a
recomputation never records a forward order nor reshards (Note [recomputed forward] covers a model that
checkpoints its own blocks, whose recomputation does fire the hooks). Positional tensor arguments are the
checkpoint's saved inputs; keyword arguments (masks, rotary tables, shared by every unit) stay referenced as
they are. A block split into units by tiling is checkpointed whole instead of unit by unit, so its
recomputation does fire its units' hooks (Note [tiles are units] in units/tiling.py).

Note [activation offload]: with `offload = "host"` the checkpoint's saved inputs (the tensors it saves
outside its own saved-tensor hooks: exactly the positional inputs) go through a `saved_tensors_hooks` pair
around the checkpoint call. Pack copies the tensor to (pinned, with CUDA) host memory on the d2h stream
and drops the device tensor once the copy is issued (the allocator is told the d2h stream still reads it);
`fetch` issues the copy back on the h2d stream for the unit next in backward order, one unit ahead (the
prefetcher calls it at the end of the forward for the first unit of the backward, and at each unit's
pre-backward for the next); unpack, inside the recomputation, makes compute wait for that copy on the
device, or issues it then if no fetch came (counted as `late`). On the CPU the host is the device: pack
and fetch still copy into separate buffers, so the same code runs.

Note [activation bytes]: the engine's forward runs under a counting `saved_tensors_hooks`: every tensor
autograd saves outside a checkpoint (the root unit's, every unit's without checkpoints, the checkpoint's
inputs) is counted once per storage (a view counts its whole storage, as memory does), parameters left out.
`activation_saved_bytes` is that sum for the last forward: what the device holds between forward and
backward. Tensors saved inside a checkpoint are not seen (they are dropped at once); the recomputation of
one unit adds that unit's saves for the duration of its backward (`infinity estimate` counts it; without
checkpoints `activation_unit_max_bytes` is the most one unit's own forward saved, which is what its
recomputation holds; with them it is the largest unit's saved inputs). Offloaded inputs count in
`activation_host_bytes`.

Note [saved alias]: a saved-tensor hook that returns the tensor it is given keeps it in its own graph when the
tensor is the output of the operation that saves it (exp, softmax, sigmoid save their result): output ->
grad_fn -> saved output, a cycle inside autograd that Python's collector cannot see, so a forward with
gradients whose result is dropped without a backward (an evaluation outside torch.no_grad) kept its whole graph
and every activation. torch itself saves an output without that reference; the hooks here return a detached
alias (the same storage, no grad_fn), which breaks the cycle and changes no gradient. (What the alias loses: a
double backward, create_graph=True, through a saved output, which the engine does not offer. torch does not
check hooked saved tensors for in-place changes, alias or not.)
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from infinity.device.streams import Streams
from infinity.runtime.compiled import compile_units
from infinity.units.builder import units_in
from infinity.units.unit import Unit


class SavedBytes:
    """The bytes of tensors saved for backward in the last forward, once per storage (Note [activation bytes])."""

    def __init__(self):
        self.device_bytes = 0
        self.host_bytes = 0
        self.per_unit: dict[int, int] = {}  # unit index -> device bytes first saved while it ran
        self.current = 0  # the unit whose forward runs now (0: the root's code)
        self._seen: set[tuple] = set()

    def reset(self) -> None:
        self.device_bytes = self.host_bytes = 0
        self.per_unit.clear()
        self.current = 0
        self._seen.clear()

    def count(self, t: torch.Tensor, on_host: bool = False) -> None:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return  # a parameter or a view of one (a transposed weight): counted as parameters
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr(), on_host)
        if key in self._seen:
            return
        self._seen.add(key)
        if on_host:
            self.host_bytes += storage.nbytes()
        else:
            self.device_bytes += storage.nbytes()
            self.per_unit[self.current] = self.per_unit.get(self.current, 0) + storage.nbytes()


class _RestoreForward:
    """Handle: removes the checkpointing forward from a module (the class's forward applies again)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


class _UnitMarks:
    """Handle pair: the unit whose forward runs, for `SavedBytes.per_unit`."""

    @staticmethod
    def install(unit: Unit, meter: SavedBytes) -> list:
        handles = []
        for module in unit.modules:
            def pre(_m, _a, u=unit):
                meter.current = u.index

            def post(_m, _a, _o):
                meter.current = 0
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        return handles


# ---------------------------------------------------------------- where a checkpoint's inputs stay


class KeepInputs:
    """`offload = "none"`: the checkpoint's inputs stay where they are (counted by the forward's meter)."""

    late = 0

    def saving(self, unit: Unit):
        return nullcontext()

    def fetch(self, indices: list[int]) -> None:
        pass

    def forget(self) -> None:
        pass


@dataclass
class _Offloaded:
    """One saved input on the host; `device` is its copy back once fetched (issue), taken by unpack (wait)."""

    unit: int
    host: torch.Tensor
    copied: object  # event: the copy to the host is done
    device: torch.Tensor | None = None
    arrived: object = None  # event: the copy back is done


class HostInputs:
    """`offload = "host"`: the checkpoint's inputs live in host memory between forward and backward
    (Note [activation offload])."""

    def __init__(self, streams: Streams, device: torch.device, meter: SavedBytes):
        self.streams, self.device, self.meter = streams, device, meter
        self.pin = device.type == "cuda"
        self._by_unit: dict[int, list[weakref.ref]] = {}  # the graph owns the records; these only find them
        self.fetched = 0  # copies back issued by fetch (ahead of use)
        self.late = 0  # copies back issued by unpack itself (nothing fetched them ahead)

    def saving(self, unit: Unit):
        def pack(t: torch.Tensor) -> _Offloaded | torch.Tensor:
            if t.device != self.device:
                return t.detach()  # not on the compute device (a CPU tensor beside a GPU's): kept (Note [saved alias])
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
            streams = self.streams
            streams.wait_event(streams.record(), streams.d2h)  # the copy reads what compute just wrote
            with streams.use(streams.d2h):
                host.copy_(t.detach(), non_blocking=self.pin)
            streams.hold(t, streams.d2h)  # the device tensor may be freed now: not reused before the copy
            rec = _Offloaded(unit=unit.index, host=host, copied=streams.record(streams.d2h))
            self._by_unit.setdefault(unit.index, []).append(weakref.ref(rec))
            self.meter.count(host, on_host=True)
            return rec

        def unpack(rec: _Offloaded | torch.Tensor) -> torch.Tensor:
            if isinstance(rec, torch.Tensor):
                return rec
            if rec.device is None:
                self.late += 1
                self._issue(rec)
            self.streams.wait_event(rec.arrived)  # compute reads the copied-back input (device-side wait)
            out, rec.device = rec.device, None  # the recomputation holds it now; a second unpack copies again
            self.streams.hold(out, self.streams.compute)
            return out

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _issue(self, rec: _Offloaded) -> None:
        streams = self.streams
        streams.wait_event(rec.copied, streams.h2d)  # the host copy must be complete before it is read back
        with streams.use(streams.h2d):
            rec.device = torch.empty(rec.host.shape, dtype=rec.host.dtype, device=self.device)
            rec.device.copy_(rec.host, non_blocking=self.pin)
        rec.arrived = streams.record(streams.h2d)

    def fetch(self, indices: list[int]) -> None:
        """Issue the copy back of the saved inputs of units `indices` (their backward comes next)."""
        for i in indices:
            for ref in self._by_unit.pop(i, ()):
                rec = ref()
                if rec is not None and rec.device is None:
                    self._issue(rec)
                    self.fetched += 1

    def forget(self) -> None:
        self._by_unit.clear()


# ---------------------------------------------------------------- the engine's surface


class Activations:
    """Counts saved activations; with checkpoint = "units", checkpoints every unit but the root."""

    def __init__(self, units: list[Unit], checkpointing: bool, inputs: KeepInputs | HostInputs, meter: SavedBytes,
                 regions: list[tuple[nn.Module, list[Unit]]] = (), compile_config=None):
        self.units, self.checkpointing, self.inputs, self.meter = units, checkpointing, inputs, meter
        self.regions = list(regions)  # split blocks and their units (Note [tiles are units] in units/tiling.py)
        self.compile_config = compile_config  # `[compile]`: None or units = false, nothing compiled

    def install(self) -> list:
        """Hooks and wrapped forwards of every unit module but the root's; returns removable handles."""
        # compiled first, so that the checkpoints below wrap the compiled forwards (Note [compiled units])
        handles = compile_units(self.compile_config, self.units) if self.compile_config is not None else []
        in_region = units_in(self.regions)
        for unit in self.units[1:]:
            handles += _UnitMarks.install(unit, self.meter)
            if self.checkpointing and unit.index not in in_region:
                for module in unit.modules:
                    module.forward = self._checkpointed(unit, module.forward)
                    handles.append(_RestoreForward(module))
        for block, units in self.regions if self.checkpointing else ():
            # a split block is checkpointed whole, its inputs kept under its last unit, the first of its backward
            block.forward = self._checkpointed(units[-1], block.forward)
            handles.append(_RestoreForward(block))
        return handles

    def _checkpointed(self, unit: Unit, forward):
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)  # nothing is saved: nothing to recompute
            with self.inputs.saving(unit):
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return run

    @contextmanager
    def forward(self):
        """Around the engine's forward: count what autograd saves (Note [activation bytes])."""
        self.meter.reset()
        self.inputs.forget()

        def pack(t):
            self.meter.count(t)
            return t.detach()  # Note [saved alias]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def fetch(self, indices: list[int]) -> None:
        self.inputs.fetch(indices)

    def report(self) -> dict:
        blocks = [v for k, v in self.meter.per_unit.items() if k != 0]
        return {"activation_saved_bytes": self.meter.device_bytes, "activation_host_bytes": self.meter.host_bytes,
                "activation_unit_max_bytes": max(blocks, default=0), "activation_late_fetches": self.inputs.late}


def activations_for(config, units: list[Unit], streams: Streams, device: torch.device,
                    regions: list[tuple[nn.Module, list[Unit]]] = ()) -> Activations:
    """The `[activation]` section's types: where checkpoint inputs stay, whether units (and split blocks,
    `regions`) are checkpointed; and `[compile]`'s, whether the units' forwards are compiled (`config`: the
    engine's Config)."""
    meter = SavedBytes()
    act = config.activation
    inputs = HostInputs(streams, device, meter) if act.offload == "host" else KeepInputs()
    return Activations(units, act.checkpoint == "units", inputs, meter, regions, compile_config=config.compile)
