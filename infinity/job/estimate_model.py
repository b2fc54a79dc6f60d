"""What `infinity estimate` knows of a model: its units at any config and world size (`unit_sizes_of`), its
parameter count and optimizer groups, and the trace of one micro-batch on meta tensors (`trace_step`, `tracer`);
from the model itself, or from two shallow copies of it.

Note [deepened estimate]: a model whose blocks repeat (a job's gpt / gpt2 / llama, a pretrained Llama or GPT-2)
is not built at its depth L: the estimator builds it with 2 and with 3 blocks (on the meta device, as always)
and extends what they give to L blocks. The units: the 3-block model's, its middle block's units repeated for
blocks 1 .. L-2 (renamed); a block's units do not depend on its position (its layout is its own parameters',
its recomputation its own block's). Numbers (activation bytes, FLOPs, parameters, group elements): affine in
the depth, f(L) = f(3) + (L - 3) * (f(3) - f(2)). Per-unit figures of the trace (what a unit saves, its
inputs): the middle block's repeated, as for the units. The largest saved tensor is the 3-block model's (the
blocks save the same shapes). tests/job/test_estimate_fast.py holds the extended estimate equal, byte for
byte, to the full model's (every tier, the activations, the table and the plans) on small configs; for a 70B
Llama this turns ~10 s of model build and trace into ~0.2 s. A model given as `module:function`, or whose
blocks may differ (a pretrained type not known to repeat one block), is built and traced whole.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from infinity.config.sections import Config
from infinity.device.dtypes import dtype_of
from infinity.job.estimate_table import sizes_key


@dataclass
class Trace:
    """One traced forward + backward on meta tensors."""

    activation_bytes: int = 0  # saved for backward, parameters excluded
    largest_saved_bytes: int = 0
    flops: float = 0.0
    error: str | None = None
    unit_saved: tuple[int, ...] = ()  # per unit but the root: the bytes its own forward saves
    unit_inputs: tuple[int, ...] = ()  # per unit but the root: its positional tensor inputs (a checkpoint's)
    unit_forward_flops: float = 0.0  # the units' forwards (what checkpoint = "units" computes again)
    unit_names: tuple[str, ...] = ()  # the units of unit_saved / unit_inputs (their modules' names)



def unit_sizes_of(model: nn.Module, config: Config, world_size: int):
    """The units `initialize` would build for `model` at `world_size` (rank 0), as placement sees them."""
    from infinity.device.streams import Streams
    from infinity.memory.stages import stage_for
    from infinity.units.builder import build_units, recomputed_units, split_regions, unit_sizes
    from infinity.units.context import UnitContext
    from infinity.units.tiling import tile_layers
    compute_dtype = dtype_of(config.precision.compute_dtype)
    from infinity.runtime.chunked_loss import kept_whole, loss_forward
    tile_layers(model, config.units.tile_bytes, compute_dtype.itemsize,
                keep=kept_whole(loss_forward(config.activation, model)))  # as initialize
    ctx = UnitContext(group=None, rank=0, world_size=world_size, device=torch.device("cpu"),
                      compute_dtype=compute_dtype, streams=Streams.for_device(torch.device("cpu")),
                      stage=stage_for(config.zero.stage), sub_group_size=config.optimizer.sub_group_size)
    units = build_units(model, list(config.units.classes), ctx)
    regions = split_regions(model, list(config.units.classes), units)
    recomputed = recomputed_units(regions, config.activation.checkpoint, config.prefetch.units_ahead)
    return unit_sizes(units, config.optimizer.sub_group_size, recomputed)


def group_counts(model: nn.Module, config: Config) -> list[dict]:
    """The optimizer groups `[optimizer] no_decay` makes of the model's trainable parameters (as initialize)."""
    from infinity.optim.groups import resolve_groups
    numel = dict(model.named_parameters())
    return [{"tensors": len(g["params"]), "elements": sum(numel[n].numel() for n in g["params"]),
             "weight_decay": g["weight_decay"], "lr": g["lr"]}
            for g in resolve_groups(model, config.optimizer, None).groups]


def trace_step(model: nn.Module, loss_fn: Callable, batch: int, seq_len: int,
               unit_modules: list[nn.Module] = ()) -> Trace:
    """Forward + backward of one micro-batch on meta tensors: saved activations and FLOPs (no memory used),
    and per unit (`unit_modules`, the root's excluded) what it saves, its inputs and its forward's FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode
    model = model.to("meta")
    params = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}
    owner: dict[int, int] = {}  # saved tensor -> the unit running when it was first saved (0: the root)
    current, inputs, unit_flops = [0], [0] * len(unit_modules), [0.0]

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            saved[id(base)] = base.numel() * base.element_size()
            owner.setdefault(id(base), current[0])
        return t
    x = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    try:
        with FlopCounterMode(display=False) as flops:
            handles = []
            for i, module in enumerate(unit_modules, start=1):
                def pre(_m, args, i=i):
                    current[0] = i
                    unit_flops[0] -= flops.get_total_flops()
                    inputs[i - 1] += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

                def post(_m, _a, _o):
                    current[0] = 0
                    unit_flops[0] += flops.get_total_flops()
                handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = loss_fn(model, x, x)
            finally:
                for h in handles:
                    h.remove()
            loss.backward()
    except Exception as e:  # noqa: BLE001 - a model that cannot run on meta tensors still gets the rest
        return Trace(error=f"{type(e).__name__}: {e}")
    per_unit = [0] * len(unit_modules)
    for key, nbytes in saved.items():
        if owner[key]:
            per_unit[owner[key] - 1] += nbytes
    return Trace(activation_bytes=sum(saved.values()), largest_saved_bytes=max(saved.values(), default=0),
                 flops=float(flops.get_total_flops()), unit_saved=tuple(per_unit), unit_inputs=tuple(inputs),
                 unit_forward_flops=float(unit_flops[0]))


def tracer(make_model: Callable, config: Config, seq_len: int) -> Callable[[int], Trace]:
    """micro-batch -> the Trace of one forward + backward of a copy of `make_model()` (tracing moves its buffers to
    the meta device), tiled and checkpointed as `initialize` does it; each micro-batch traced once."""
    traced = make_model()
    from infinity.runtime.chunked_loss import kept_whole, loss_forward  # the engine's forward (Note [chunked loss])
    from infinity.units.builder import activation_modules
    from infinity.units.tiling import tile_layers
    forward = loss_forward(config.activation, traced.model)
    tile_layers(traced.model, config.units.tile_bytes, dtype_of(config.precision.compute_dtype).itemsize,
                keep=kept_whole(forward))  # as initialize
    named = activation_modules(traced.model, list(config.units.classes))
    blocks, names = [m for _, m in named], tuple(n for n, _ in named)
    return functools.cache(lambda batch: dataclasses.replace(trace_step(
        traced.model, lambda _m, x, y: traced.loss(forward, x, y), batch, seq_len, blocks), unit_names=names))


@dataclass(frozen=True)
class Depth:
    """A model whose blocks repeat: `layers` blocks in full; `build(d)` makes the same model with d blocks."""

    layers: int
    build: Callable[[int], object]


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class WholeModel:
    """The model built at its depth: everything from it (the estimate as it always was)."""

    def __init__(self, make_model: Callable):
        self.make_model = make_model
        self.bundle = make_model()
        self.num_params = _count(self.bundle.model)
        self._sizes: dict = {}

    def sizes_of(self, config: Config, world: int):
        """The units `initialize` builds for this model at `world` (rank 0), once per distinct `sizes_key`."""
        key = sizes_key(config, world)
        if key not in self._sizes:
            self._sizes[key] = unit_sizes_of(self.bundle.model, config, world)
        return self._sizes[key]

    def groups(self, config: Config) -> list[dict]:
        return group_counts(self.bundle.model, config)

    def tracer(self, config: Config, seq_len: int) -> Callable[[int], Trace]:
        return tracer(self.make_model, config, seq_len)


class DeepenedModel:
    """Note [deepened estimate]: the model of `depth.layers` blocks from its 2- and 3-block copies."""

    def __init__(self, depth: Depth, blocks_path: str, shallow: dict):
        self.depth, self.path = depth, blocks_path
        self.shallow = shallow  # blocks -> the bundle of that many
        self.bundle = self.shallow[3]  # what the estimate reads of the bundle (`weights`) is depth-free
        self.num_params = self._extend(_count(self.shallow[2].model), _count(self.shallow[3].model))
        self._sizes: dict = {}

    def _extend(self, at2, at3):
        """f(L) from f(2) and f(3), f affine in the depth."""
        return type(at3)(at3 + (self.depth.layers - 3) * (at3 - at2))

    def _block(self, name: str) -> int | None:
        """The block a unit (or activation module) of the 3-block copy belongs to, None outside them."""
        for b in range(3):
            head = f"{self.path}.{b}"
            if name == head or name.startswith(head + "."):
                return b
        return None

    def _deepen(self, names: list[str], items: list, rename: Callable | None = None) -> list:
        """The 3-block copy's `items` (one per name, in module order) for `layers` blocks: block 1's repeated
        for blocks 1 .. L-2 (`rename(item, old, new)` gives each its block's name), block 2's as block L-1."""
        out, last = [], self.depth.layers - 1
        middle = [(n, it) for n, it in zip(names, items) if self._block(n) == 1]
        for name, item in zip(names, items):
            b = self._block(name)
            if b == 0 or b is None:
                out.append(item)
            elif b == 1 and name == middle[0][0]:
                for i in range(1, last):
                    out += [rename(it, f"{self.path}.1", f"{self.path}.{i}") if rename else it for _, it in middle]
            elif b == 2:
                out.append(rename(item, f"{self.path}.2", f"{self.path}.{last}") if rename else item)
        return out

    def sizes_of(self, config: Config, world: int):
        key = sizes_key(config, world)
        if key not in self._sizes:
            sizes = unit_sizes_of(self.shallow[3].model, config, world)

            def rename(u, old, new):
                return dataclasses.replace(u, name=new + u.name[len(old):])
            self._sizes[key] = tuple(self._deepen([u.name for u in sizes], list(sizes), rename))
        return self._sizes[key]

    def groups(self, config: Config) -> list[dict]:
        for d in (2, 3):  # tiled as `sizes_of` tiles a model (the whole model's groups are counted tiled too)
            unit_sizes_of(self.shallow[d].model, config, 1)
        two, three = group_counts(self.shallow[2].model, config), group_counts(self.shallow[3].model, config)
        return [{**g3, "tensors": self._extend(g2["tensors"], g3["tensors"]),
                 "elements": self._extend(g2["elements"], g3["elements"])} for g2, g3 in zip(two, three)]

    def tracer(self, config: Config, seq_len: int) -> Callable[[int], Trace]:
        at = {d: tracer(lambda d=d: self.depth.build(d), config, seq_len) for d in (2, 3)}

        def trace_at(batch: int) -> Trace:
            two, three = at[2](batch), at[3](batch)
            if three.error:
                return three
            names = list(three.unit_names)
            return Trace(activation_bytes=self._extend(two.activation_bytes, three.activation_bytes),
                         largest_saved_bytes=three.largest_saved_bytes,
                         flops=self._extend(two.flops, three.flops),
                         unit_saved=tuple(self._deepen(names, list(three.unit_saved))),
                         unit_inputs=tuple(self._deepen(names, list(three.unit_inputs))),
                         unit_forward_flops=self._extend(two.unit_forward_flops, three.unit_forward_flops))
        return functools.cache(trace_at)


def blocks_path(model: nn.Module, blocks: int) -> str | None:
    """The path of the `nn.ModuleList` of `blocks` blocks of the same class (None: not exactly one)."""
    found = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == blocks
             and len({type(b) for b in m}) == 1 and any(True for _ in m.parameters())]
    return found[0] if len(found) == 1 else None


def model_facts(make_model: Callable, depth: Depth | None = None):
    """The model's facts for the estimate: deepened (Note [deepened estimate]) when `depth` says its blocks repeat
    more than 3 times and its 2- and 3-block copies have one list of blocks at the same path; else whole."""
    if depth is not None and depth.layers > 3:
        shallow = {d: depth.build(d) for d in (2, 3)}
        path = blocks_path(shallow[3].model, 3)
        if path is not None and path == blocks_path(shallow[2].model, 2):
            return DeepenedModel(depth, path, shallow)
    return WholeModel(make_model)


# pretrained model types whose every block is the same (Note [deepened estimate])
REPEATING_PRETRAINED = ("llama", "gpt2")


def job_depth(model_cfg, lora_cfg=None, *, own_llama: bool = False) -> Depth | None:
    """The depth of the job's model (`[model]`, `[model.lora]`) and its shallow builds; None when its blocks
    may differ (a pretrained type not in REPEATING_PRETRAINED, or one that lists its layers' types).
    `own_llama`: a `[model]` Llama shape, or a pretrained Llama whose config.json (and LoRA targets) the copy
    models, is built as the estimator's copy (Note [estimator's Llama]), without transformers or PEFT."""
    from infinity.job.build import build_model, estimator_llama
    from infinity.job.spec import LoraConfig
    layers = model_cfg.n_layer
    if own_llama and model_cfg.kind == "llama" and not model_cfg.pretrained:
        return Depth(layers, lambda d: estimator_llama(model_cfg, d))
    if model_cfg.pretrained:
        import json
        import os
        try:
            with open(os.path.join(model_cfg.pretrained, "config.json")) as f:
                hf = json.load(f)
        except (OSError, ValueError):
            return None  # building the model whole names what is wrong with it
        layers = hf.get("num_hidden_layers", hf.get("n_layer"))
        if hf.get("model_type") not in REPEATING_PRETRAINED or "layer_types" in hf or not isinstance(layers, int):
            return None
        if own_llama:  # a Llama the copy models, LoRA targets it resolves (Note [estimator's Llama])
            from infinity.job.build import estimator_pretrained_llama
            from infinity.job.estimate_llama import llama_fields, lora_targets
            fields, targets = llama_fields(hf), lora_targets(tuple(lora_cfg.targets)) if lora_cfg else ()
            if fields is not None and targets is not None:
                return Depth(layers, lambda d: estimator_pretrained_llama(model_cfg, lora_cfg or LoraConfig(), hf,
                                                                          fields, targets, d))
    return Depth(layers, lambda d: build_model(model_cfg, lora_cfg, layers=d))
