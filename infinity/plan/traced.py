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
blocks save the same shapes). tests/plan/test_estimate_fast.py holds the extended estimate equal, byte for
byte, to the full model's (every tier, the activations, the table and the plans) on small configs; for a 70B
Llama this turns ~10 s of model build and trace into ~0.2 s. A model given as `module:function`, or whose
blocks may differ (a pretrained type not known to repeat one block), is built and traced whole.

Note [small twin]: a meta trace costs more to start than to run. torch's meta kernels of elementwise operations are
Python (torch._refs) wrapped to keep dynamo out, and the first call imports torch._dynamo and sympy: ~1.1 s of a 70B
estimate's ~4.5 s, for four traces of ~0.07 s each. The estimator's Llama (Note [estimator's Llama]) and the
built-in GPT are traced as their small twins instead: the same model (depth, dtype, LoRA targets and dropout, tied
embeddings), on the CPU with zeros for weights, each of its sizes replaced by a distinct odd prime, the smallest
where they multiply most (key/value heads 3, query heads per key/value head 5, half a head 7: d = 210; micro-batch
11, sequence 13; then the MLP width, the vocabulary, LoRA's rank), a size of 1 kept 1, and attention on torch's
fused kernel (as the meta trace runs it: Note [fused attention]). Every count the trace takes (a saved tensor's
elements, an input's, one operation's FLOPs) is then a product of those primes and of 2s (a head is two halves, a
multiply-add two FLOPs): its factorization names the product of sizes it is, and the same product of the full sizes
is the full model's count
(`twin_scale`). A model whose shapes hold another constant says so (`Twin.constants`): the GPT's qkv is 3 d wide, so
its sizes take primes from 5 (heads 5, head width 7) and a 3 stays a 3. A count with another odd factor, a trace
that fails, or units that differ fall back to the meta trace, as do a tiled model (its tiles depend on its sizes)
and a chunked loss. What this rests on: the models' counts are such products, with no odd constant but those
declared (an undeclared one equal to one of the primes would be misread). tests/plan/test_estimate_fast.py holds the
twin's Trace equal to the meta trace field by field (the Llama in fp32 / bf16 / fp16, grouped-query or not, LoRA
all-linear with dropout or q/v, tied embeddings; the GPT checkpointed or not; micro-batch 1 and 3, 2 and 3 blocks),
and a 70B estimate importing neither torch._dynamo nor sympy. The twin's traces take ~0.03 s each (fp16 stays fp16:
at d = 210 its slow CPU matmuls still take milliseconds).
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
from infinity.memory.cost_model import Work, step_work
from infinity.plan.table import sizes_key


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
    bytes: float = 0.0  # read and written by the operations without a FLOP formula (Note [compute time])
    ops: float = 0.0  # operations run
    unit_forward_bytes: float = 0.0  # the same of the units' forwards
    unit_forward_ops: float = 0.0

    def step_work(self, checkpoint: str) -> Work:
        """One micro-batch's forward + backward (Note [compute time]), its recomputation included (Note
        [recompute])."""
        return step_work(Work(self.flops, self.bytes, self.ops),
                         Work(self.unit_forward_flops, self.unit_forward_bytes, self.unit_forward_ops), checkpoint)



WORK_FIELDS = ("bytes", "ops", "unit_forward_bytes", "unit_forward_ops")  # (beside the FLOPs: Note [compute time])


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


class _HeldMode:
    """A torch mode (its class built in `__init__`, its imports deferred) entered and left as this object."""

    _mode = None

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


class FlopCount(_HeldMode):
    """The FLOPs of the operations run inside it, by torch's own formulas (`torch.utils.flop_counter`'s registry),
    counted as torch's `FlopCounterMode` counts them (an operation without a formula is counted through its
    decomposition), total only (tests/plan/test_estimate_fast.py holds the two equal); each operation's count
    through `scale` (a small twin's, Note [small twin]). Beside them (Note [compute time] in memory/cost_model.py):
    `bytes`, what the operations without a formula read and write (their tensor arguments and results; a view's
    none), each tensor's elements through `scale`, and `ops`, the operations run.

    Note [flop count without dynamo]: `FlopCounterMode`, like every `TorchDispatchMode` subclass by default,
    wraps its dispatch in `torch._disable_dynamo`, whose first call imports `torch._dynamo`: ~1.2 s of a 70B
    estimate's ~5 s, for a trace that never compiles. This mode opts out (`_should_skip_dynamo`, the hook
    torch's `TorchDispatchMode` documents for it); the trace runs no compiled code inside it."""

    def __init__(self, scale: Callable[[int], int] = int):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry
        formulas = dict(flop_registry)  # its formulas take tensors (register_flop_formula wraps them to shapes)
        formulas.update(_FUSED_ATTENTION_FLOPS)  # (the fused attention a trace runs: Note [fused attention])
        counter = self
        self.total = self.bytes = self.ops = 0
        aten = torch.ops.aten
        queries = {aten.sym_is_contiguous.default, aten.is_contiguous.default, aten.is_contiguous.memory_format,
                   aten.is_strides_like_format.default, aten.is_non_overlapping_and_dense.default,
                   aten.size.default, aten.sym_size.default, aten.stride.default, aten.sym_stride.default,
                   aten.storage_offset.default, aten.sym_storage_offset.default, aten.numel.default,
                   aten.sym_numel.default, aten.dim.default, torch.ops.prim.layout.default}  # answered below it

        class Mode(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls):
                return False  # Note [flop count without dynamo]

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in queries:
                    return NotImplemented
                if func is not torch.ops.prim.device.default:  # as FlopCounterMode: its decomposition, if any
                    with self:
                        out = func.decompose(*args, **kwargs)
                    if out is not NotImplemented:
                        return out
                out = func(*args, **kwargs)
                counter.ops += 1
                formula = formulas.get(func._overloadpacket)
                if formula is not None:
                    counter.total += scale(formula(*args, **kwargs, out_val=out))
                elif not _is_view(func):
                    counter.bytes += _tensor_bytes((args, kwargs, out), scale)
                return out
        self._mode = Mode()

    def get_total_flops(self) -> int:
        return self.total

    def work(self) -> Work:
        return Work(float(self.total), float(self.bytes), float(self.ops))


def _is_view(func) -> bool:
    """An operation whose results alias an argument without writing it (a view: no bytes move)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _tensor_bytes(value, scale: Callable[[int], int]) -> int:
    """The bytes of the tensors in `value` (nested lists, tuples and dicts), each tensor's elements through `scale`."""
    if isinstance(value, torch.Tensor):
        return scale(value.numel()) * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, scale) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, scale) for v in value.values())
    return 0


def _attention_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    """A fused attention's forward: the two matmuls, QK^T and PV, over every query head (grouped-query heads as
    the math kernel counts them, expanded)."""
    b, h, s_q, d = query.shape
    return 2 * b * h * s_q * key.shape[-2] * (d + value.shape[-1])


def _attention_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    """Its backward: four matmuls, twice the forward (as torch's formulas and the math kernel's backward count)."""
    return 2 * _attention_flops(query, key, value)


_FUSED_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
}


class FusedAttention(_HeldMode):
    """Note [fused attention]: inside it, `F.scaled_dot_product_attention` without dropout runs torch's fused CPU
    kernel (`_scaled_dot_product_flash_attention_for_cpu`, which has a meta kernel too), whatever the device.

    A real run's attention is fused: flash or memory-efficient on a GPU, flash on the CPU (torch's dispatch picks
    it for these inputs), grouped-query heads included. It saves its inputs, its output and a log-sum-exp per
    query: no b x h x s x s probabilities. On meta tensors the dispatch can only pick the math kernel, which
    saves them (twice: the weights and the softmax's output), so the estimate counted that much more activation
    memory per block: at a 7B's 32 heads and 4096 tokens in fp32, 4.3 GB a block. A fused kernel's FLOPs are its two
    matmuls (`_attention_flops`), what the math kernel's were. With dropout the dispatch is left as it is."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode
        sdpa = torch.nn.functional.scaled_dot_product_attention
        fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is sdpa:
                    named = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                                      "enable_gqa"), args)) | kwargs
                    if not named.get("dropout_p"):
                        return fused(named["query"], named["key"], named["value"], 0.0, named.get("is_causal", False),
                                     attn_mask=named.get("attn_mask"), scale=named.get("scale"))[0]
                return func(*args, **kwargs)
        self._mode = Mode()


def trace_step(model: nn.Module, loss_fn: Callable, batch: int, seq_len: int,
               unit_modules: list[nn.Module] = (), scale: Callable[[int], int] | None = None) -> Trace:
    """Forward + backward of one micro-batch on meta tensors: saved activations and FLOPs (no memory used),
    and per unit (`unit_modules`, the root's excluded) what it saves, its inputs and its forward's FLOPs.
    With `scale`: `model` is a small twin on the CPU (Note [small twin]), every count of elements and of FLOPs
    is scaled to the full model's by `scale`. Attention runs torch's fused kernel either way (Note [fused
    attention]), as a real run's does."""
    if scale is None:
        model, device, scale = model.to("meta"), "meta", int
    else:
        device = "cpu"
    params = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}
    owner: dict[int, int] = {}  # saved tensor -> the unit running when it was first saved (0: the root)
    current, inputs, unit_work, started = [0], [0] * len(unit_modules), [Work()], [Work()]

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            saved[id(base)] = scale(base.numel()) * base.element_size()
            owner.setdefault(id(base), current[0])
        return t
    x = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    try:
        with FlopCount(scale) as flops, FusedAttention():
            handles = []
            for i, module in enumerate(unit_modules, start=1):
                def pre(_m, args, i=i):
                    current[0] = i
                    started[0] = flops.work()
                    inputs[i - 1] += sum(scale(a.numel()) * a.element_size() for a in args
                                         if isinstance(a, torch.Tensor))

                def post(_m, _a, _o):
                    current[0] = 0
                    unit_work[0] += flops.work() - started[0]
                handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = loss_fn(model, x, x)
            finally:
                for h in handles:
                    h.remove()
            loss.backward()
        for p in model.parameters():
            p.grad = None  # (a trace again of the same model must not add to them: operations a run does not run)
    except Exception as e:  # noqa: BLE001 - a model that cannot run on meta tensors still gets the rest
        return Trace(error=f"{type(e).__name__}: {e}")
    per_unit = [0] * len(unit_modules)
    for key, nbytes in saved.items():
        if owner[key]:
            per_unit[owner[key] - 1] += nbytes
    total, unit = flops.work(), unit_work[0]
    return Trace(activation_bytes=sum(saved.values()), largest_saved_bytes=max(saved.values(), default=0),
                 flops=total.flops, unit_saved=tuple(per_unit), unit_inputs=tuple(inputs),
                 unit_forward_flops=unit.flops, bytes=total.bytes, ops=total.ops, unit_forward_bytes=unit.bytes,
                 unit_forward_ops=unit.ops)


class TwinMismatch(Exception):
    """A count of the small twin's that is not a product of its sizes (Note [small twin]): the meta trace then."""


TWIN_PRIMES = (3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47)


def twin_scale(full: dict[str, int], constants: tuple[int, ...] = (2,)) -> tuple[dict[str, int],
                                                                              Callable[[int], int]]:
    """Note [small twin]: the twin's sizes for the model's `full` sizes (symbol -> value; a size of 1 stays 1, each
    other a distinct odd prime that is not one of the model's `constants`, the smallest first, in the order given)
    and the map from a count of the twin's (a product of its sizes, times its constants) to the same product of the
    full sizes."""
    primes = iter(p for p in TWIN_PRIMES if p not in constants)
    small = {name: 1 if value == 1 else next(primes) for name, value in full.items()}
    pairs = [(small[name], full[name]) for name in full if small[name] != 1]

    def scale(n: int) -> int:
        if n == 0:
            return 0
        out, rest = 1, n
        for prime, value in pairs:
            while rest % prime == 0:
                rest //= prime
                out *= value
        left = rest
        for constant in constants:
            while left % constant == 0:
                left //= constant
        if left != 1:
            raise TwinMismatch(f"{n} is not a product of the twin's sizes {small} and of {constants}")
        return out * rest
    return small, scale


@dataclass(frozen=True)
class Twin:
    """A model that can be built at other sizes (Note [small twin]): its own `sizes` (symbol -> value) and
    `build(sizes)`, the same model (its depth, dtype, LoRA) at those sizes, on the meta device."""

    sizes: dict
    build: Callable[[dict], object]
    constants: tuple[int, ...] = (2,)  # the primes the model's shapes hold as constants (the GPT's qkv: 3)


def _materialized(bundle):
    """A twin's meta-device model with its parameters as zeros on the CPU, tied ones still tied (values do not
    matter to a trace; `to_empty` would run torch's Python meta kernels, which import torch._dynamo)."""
    made: dict[int, nn.Parameter] = {}
    for module in bundle.model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.device.type == "meta":
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
    return bundle


class TwinTrace:
    """Traces of a model as its small twin (Note [small twin]), untiled, its loss unchunked: micro-batch -> the
    Trace of the full model, or TwinMismatch where a count is not a product of the twin's sizes."""

    def __init__(self, twin: Twin, config: Config, seq_len: int):
        self.twin, self.config, self.seq_len = twin, config, seq_len
        self._built: dict = {}  # the twin's sizes -> its bundle, on the CPU

    def __call__(self, batch: int) -> Trace:
        from infinity.units.builder import activation_modules
        sizes, scale = twin_scale({k: {"batch": batch, "seq": self.seq_len}.get(k, v)
                                   for k, v in self.twin.sizes.items()}, self.twin.constants)
        model_sizes = {k: v for k, v in sizes.items() if k not in ("batch", "seq")}
        key = tuple(model_sizes.values())
        if key not in self._built:
            self._built[key] = _materialized(self.twin.build(model_sizes))
        bundle = self._built[key]
        named = activation_modules(bundle.model, list(self.config.units.classes))
        result = trace_step(bundle.model, lambda m, x, y: bundle.loss(m, x, y), sizes["batch"], sizes["seq"],
                            [m for _, m in named], scale=scale)
        if result.error is not None:
            raise TwinMismatch(result.error)
        return dataclasses.replace(result, unit_names=tuple(n for n, _ in named))


def tracer(make_model: Callable, config: Config, seq_len: int, twin: Twin | None = None) -> Callable[[int], Trace]:
    """micro-batch -> the Trace of one forward + backward of a copy of `make_model()` (tracing moves its buffers to
    the meta device), tiled and checkpointed as `initialize` does it; each micro-batch traced once. With a `twin`
    (an untiled model, its loss unchunked): traced as its small twin (Note [small twin])."""
    traced = make_model()
    from infinity.runtime.chunked_loss import kept_whole, loss_forward  # the engine's forward (Note [chunked loss])
    from infinity.units.builder import activation_modules
    from infinity.units.tiling import tile_layers
    forward = loss_forward(config.activation, traced.model)
    tiling = tile_layers(traced.model, config.units.tile_bytes, dtype_of(config.precision.compute_dtype).itemsize,
                         keep=kept_whole(forward))  # as initialize
    named = activation_modules(traced.model, list(config.units.classes))
    blocks, names = [m for _, m in named], tuple(n for n, _ in named)
    as_twin = TwinTrace(twin, config, seq_len) if twin is not None else None

    def trace(batch: int) -> Trace:
        if as_twin is not None and forward is traced.model and not tiling.parts:
            try:
                result = as_twin(batch)
                if result.unit_names == names:
                    return result
            except TwinMismatch:
                pass  # the meta trace, as for a model without a twin
        return dataclasses.replace(trace_step(traced.model, lambda _m, x, y: traced.loss(forward, x, y), batch,
                                              seq_len, blocks), unit_names=names)
    return functools.cache(trace)


@dataclass(frozen=True)
class Depth:
    """A model whose blocks repeat: `layers` blocks in full; `build(d)` makes the same model with d blocks;
    with `sizes` (its symbols, Note [small twin]) `build(d, sizes)` makes it at those sizes."""

    layers: int
    build: Callable[..., object]
    sizes: dict | None = None
    constants: tuple[int, ...] = (2,)  # (Twin's)

    def twin(self, blocks: int) -> Twin | None:
        return None if self.sizes is None else Twin(self.sizes, lambda sizes: self.build(blocks, sizes),
                                                    self.constants)


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
        at = {d: tracer(lambda d=d: self.depth.build(d), config, seq_len, self.depth.twin(d)) for d in (2, 3)}

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
                         unit_forward_flops=self._extend(two.unit_forward_flops, three.unit_forward_flops),
                         **{f: self._extend(getattr(two, f), getattr(three, f)) for f in WORK_FIELDS})
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
    from infinity.config.job import LoraConfig
    from infinity.models.build import build_model, estimator_llama, gpt_sizes, llama_sizes
    layers = model_cfg.n_layer
    if own_llama and model_cfg.kind == "llama" and not model_cfg.pretrained:
        return Depth(layers, lambda d, sizes=None: estimator_llama(model_cfg, d, sizes), llama_sizes(model_cfg))
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
            from infinity.models.build import estimator_pretrained_llama
            from infinity.models.llama import copy_sizes, llama_fields, lora_targets
            fields, targets = llama_fields(hf), lora_targets(tuple(lora_cfg.targets)) if lora_cfg else ()
            if fields is not None and targets is not None:
                lora = lora_cfg or LoraConfig()
                sizes = copy_sizes(fields["vocab"], fields["d"], fields["heads"], fields["kv_heads"], fields["ffn"],
                                   lora.r)
                return Depth(layers, lambda d, sizes=None: estimator_pretrained_llama(model_cfg, lora, hf, fields,
                                                                                      targets, d, sizes), sizes)
    if model_cfg.kind == "gpt" and not model_cfg.pretrained:  # the built-in GPT: its twin (Note [small twin])
        return Depth(layers, lambda d, sizes=None: build_model(model_cfg, lora_cfg, layers=d, sizes=sizes),
                     gpt_sizes(model_cfg), constants=(2, 3))
    return Depth(layers, lambda d: build_model(model_cfg, lora_cfg, layers=d))
