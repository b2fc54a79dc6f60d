"""ZeRO stages: which state kinds a rank holds whole and which only its partition of.

One type per stage (`Stage0` .. `Stage3`, picked once by `stage_for(n)`). A stage
answers, for one unit on one rank, the geometry of what the rank stores of each
state kind (`UnitLayout`: start, length and chunks in the unit's flat buffer),
the collective that reduces gradients, whether parameters are all-gathered
before use, and the formulas the layout must meet. It is orthogonal to the
tier each kind lives on (memory/placement.py): stage 2 with the optimizer on
host is ZeRO-Offload, stage 3 with NVMe is ZeRO-Infinity.

Note [stage layouts]: a unit's flat buffer (trainable parameters first, padded
to a multiple of the world size N) is cut into N partitions of `s` elements;
rank r owns partition r: [r*s, (r+1)*s). Only trainable elements ([0, T)) have
gradients and optimizer state ("frozen weights cost only their weights"):

    stage  params              grads                      master, exp_avg, exp_avg_sq (the update range)
    0      whole  [0, N*s)     whole trainable [0, T)     whole trainable [0, T)
    1      whole  [0, N*s)     whole trainable [0, T)     partition ∩ trainable
    2      whole  [0, N*s)     partition ∩ trainable      partition ∩ trainable
    3      partition           partition ∩ trainable      partition ∩ trainable

Every layout that spans several partitions is chunked partition by partition
(`chunk_numels` of each partition's trainable part, then of its frozen part),
so rank r's update chunks are a contiguous run of the whole layout's chunks,
starting at `first_chunk`: the optimizer's chunk c of rank r is chunk
`first_chunk + c` of the parameters and gradients. The optimizer works on the
update range's chunks; a store of its master chunk writes the same elements of
the parameters.

Gradients: stage 0 accumulates the micro-batches' gradients locally and
all-reduces once per step (DDP's no_sync); stage 1 accumulates locally and
reduce-scatters once per step into its partition (of the whole gradient it
keeps); stages 2 and 3 reduce-scatter every micro-batch and keep the partition.
Parameters: stage 3 all-gathers them before each use (forward and backward);
stages 1 and 2 hold them whole and all-gather the updated partitions once
after each update; stage 0 steps the whole model on every rank.

Communication per step and rank, in elements of Ψ parameters (a ring all-reduce
counted as reduce-scatter + all-gather, each 1 per element of the whole
buffer): stages 0-2 move 2Ψ, stage 3 3Ψ; with A micro-batches per step stage 2
reduce-scatters A times and stage 3 also gathers twice per micro-batch
(`comm_elements`).
"""

from __future__ import annotations

from dataclasses import dataclass

from infinity.memory.tier import Kind

CHUNK_ALIGN = 4096  # elements; NVMe chunk boundaries stay 4 KiB-aligned, and fused Adam's 64-element blocks
STAGES = (0, 1, 2, 3)


def chunk_numels(numel: int, sub_group_size: int) -> tuple[int, ...]:
    """Split `numel` elements into optimizer sub-groups of at most `sub_group_size` elements."""
    size = max(CHUNK_ALIGN, sub_group_size // CHUNK_ALIGN * CHUNK_ALIGN)
    full, rest = divmod(numel, size)
    return (size,) * full + ((rest,) if rest else ())


def padded_numel(numel: int, world_size: int) -> int:
    return -(-numel // world_size) * world_size if numel else 0


@dataclass(frozen=True)
class KindLayout:
    """What one rank stores of one state kind of one unit: elements [start, start + numel) of the unit's
    flat buffer, split into `chunks`; its update range (the optimizer's chunks) begins at chunk
    `first_chunk` and spans `update_chunks` chunks."""

    start: int
    numel: int
    chunks: tuple[int, ...]
    first_chunk: int = 0
    update_chunks: int = 0

    def __post_init__(self):
        assert sum(self.chunks) == self.numel, (self.chunks, self.numel)
        assert 0 <= self.first_chunk and self.first_chunk + self.update_chunks <= len(self.chunks), self

    def chunk_start(self, chunk: int) -> int:
        """Offset of `chunk` within this layout (not the flat buffer)."""
        return sum(self.chunks[:chunk])


@dataclass(frozen=True)
class UnitLayout:
    """One rank's layouts of one unit, by kind (the three optimizer kinds share one)."""

    params: KindLayout
    grads: KindLayout
    update: KindLayout  # master, exp_avg, exp_avg_sq
    unsharded_numel: int  # the whole unit, padded to the world size
    flat_grad_numel: int  # the fp32 flat gradient a backward fills (Note [trainable flat gradient])

    def of(self, kind: Kind) -> KindLayout:
        if kind is Kind.PARAMS:
            return self.params
        if kind is Kind.GRADS:
            return self.grads
        return self.update

    def optimizer_chunk(self, kind: Kind, chunk: int) -> int:
        """The chunk of `kind` that holds the same elements as the optimizer's chunk `chunk`."""
        return self.of(kind).first_chunk + chunk


def _whole(parts: list[tuple[int, int]], rank: int, sub_group: int) -> KindLayout:
    """A layout over several partitions (each (trainable, frozen) elements), chunked partition by partition,
    with `rank`'s trainable chunks as its update range."""
    chunks: list[int] = []
    first = count = 0
    for p, (trainable, frozen) in enumerate(parts):
        own = chunk_numels(trainable, sub_group)
        if p == rank:
            first, count = len(chunks), len(own)
        chunks += own + chunk_numels(frozen, sub_group)
    return KindLayout(0, sum(chunks), tuple(chunks), first, count)


class Stage:
    """The geometry and the collectives of one ZeRO stage (subclasses set the class attributes)."""

    gathers_params: bool  # parameters are partitioned and all-gathered before each use
    gathers_after_update: bool  # parameters are whole; each rank's updated partition is all-gathered
    grads_partitioned: bool  # only the rank's partition of the gradient is kept
    reduce_every_micro_batch: bool  # reduce-scatter per micro-batch (else accumulate locally, reduce once)
    optimizer_partitioned: bool
    name: str

    def layout(self, flat_numel: int, trainable_numel: int, world_size: int, rank: int,
               sub_group_size: int) -> UnitLayout:
        """What rank `rank` stores of a unit of `flat_numel` elements, the first `trainable_numel` trainable."""
        padded = padded_numel(flat_numel, world_size)
        T = trainable_numel
        if not self.optimizer_partitioned:  # stage 0: one partition, every kind whole, the update chunks lead
            whole = _whole([(T, 0)], 0, sub_group_size)
            return UnitLayout(params=_whole([(T, padded - T)], 0, sub_group_size), grads=whole, update=whole,
                              unsharded_numel=padded, flat_grad_numel=T)
        s = padded // world_size
        parts = [(t, s - t) for t in (max(0, min(s, T - p * s)) for p in range(world_size))]
        own_t, own_f = parts[rank]
        own = chunk_numels(own_t, sub_group_size)
        update = KindLayout(rank * s, own_t, own, 0, len(own))
        if self.gathers_params:
            params = KindLayout(rank * s, s, own + chunk_numels(own_f, sub_group_size), 0, len(own))
        else:
            params = _whole(parts, rank, sub_group_size)
        grads = update if self.grads_partitioned else _whole([(t, 0) for t, _ in parts], rank, sub_group_size)
        flat_grad = padded if world_size > 1 else T  # (reduce-scattered: Note [trainable flat gradient])
        return UnitLayout(params=params, grads=grads, update=update, unsharded_numel=padded, flat_grad_numel=flat_grad)

    # ----------------------------------------------------------------- formulas
    def bytes_per_rank(self, psi: int, world_size: int, *, param_bytes: int = 2, grad_bytes: int = 4,
                       optimizer_bytes: int = 12) -> int:
        """The seeds' per-rank formula for Ψ = `psi` parameters, all trainable, ignoring padding:
        DDP (2+2+K)Ψ, ZeRO-1 (2+2)Ψ + KΨ/N, ZeRO-2 2Ψ + (2+K)Ψ/N, ZeRO-3 (2+2+K)Ψ/N, with the
        project's dtypes (fp32 gradients count 4)."""
        n = world_size
        p = psi * param_bytes / (n if self.gathers_params else 1)
        g = psi * grad_bytes / (n if self.grads_partitioned else 1)
        k = psi * optimizer_bytes / (n if self.optimizer_partitioned else 1)
        return round(p + g + k)

    def comm_elements(self, psi: int, world_size: int, grad_accum_steps: int = 1) -> int:
        """Elements one rank sends through collectives per optimizer step (all-reduce = 2, reduce-scatter
        and all-gather = 1 per element of the whole buffer); 0 at world size 1."""
        return sum(self.comm_parts(psi, world_size, grad_accum_steps))

    def comm_parts(self, psi: int, world_size: int, grad_accum_steps: int = 1) -> tuple[int, int]:
        """`comm_elements` as (gradient elements reduced, parameter elements gathered): they travel at
        different dtypes (fp32 gradients, compute-dtype parameters)."""
        if world_size == 1:
            return 0, 0
        reductions = grad_accum_steps if self.reduce_every_micro_batch else 1
        gathers = 2 * grad_accum_steps if self.gathers_params else (1 if self.gathers_after_update else 0)
        reduce_cost = 1 if self.optimizer_partitioned or self.grads_partitioned else 2  # stage 0 all-reduces
        return psi * reductions * reduce_cost, psi * gathers


class Stage0(Stage):
    """Plain data parallelism (DDP): everything replicated, gradients all-reduced once per step."""

    name = "DDP"
    gathers_params = gathers_after_update = grads_partitioned = optimizer_partitioned = False
    reduce_every_micro_batch = False


class Stage1(Stage):
    """Optimizer state partitioned; gradients accumulated whole, reduce-scattered once per step."""

    name = "ZeRO-1"
    gathers_params = grads_partitioned = reduce_every_micro_batch = False
    gathers_after_update = optimizer_partitioned = True


class Stage2(Stage):
    """Optimizer state and gradients partitioned; parameters whole, updated partitions all-gathered."""

    name = "ZeRO-2"
    gathers_params = False
    gathers_after_update = grads_partitioned = reduce_every_micro_batch = optimizer_partitioned = True


class Stage3(Stage):
    """Everything partitioned; parameters all-gathered before each use (forward and backward)."""

    name = "ZeRO-3"
    gathers_after_update = False
    gathers_params = grads_partitioned = reduce_every_micro_batch = optimizer_partitioned = True


_STAGES = {0: Stage0(), 1: Stage1(), 2: Stage2(), 3: Stage3()}


def stage_for(number: int) -> Stage:
    """The one place a stage number becomes its type."""
    assert number in _STAGES, number  # config validation names the allowed values
    return _STAGES[number]
