"""Cost model of a training step: bytes per link for a placement plan, and the predicted step time.

Link rates (measured and cached by `infinity.link_rates`; this module only
computes with the rates it is given):

    nvme_read, nvme_write   io_engine throughput on the swap directory's disk (bytes/s)
    h2d, d2h                pinned host <-> GPU copies (bytes/s); free without a GPU
    cpu_adam                fused CPU Adam (elements/s); device_adam the same on the GPU
    matmul_flops            dense matmul throughput of the compute device (FLOP/s)

Note [traffic per step]: what one optimizer step with `accum` micro-batches moves,
per unit shard (P, G, O = its params, gradient and optimizer-state bytes):

    params     fetched before forward and again before backward: 2 * accum fetches
               (the root unit stays gathered from forward to the end of backward: accum).
               nvme: read P each fetch (+ h2d P with a GPU); host: h2d P with a GPU.
               After the optimizer step the new params are written: nvme: write P; the
               first fetch after it reads the copy kept in memory, not the disk (Note
               [fresh parameters]: every unit with deferred updates, the default; the
               engine's `kept_params` says which chunks in other modes).
    grads      each micro-batch's reduced shard is stored (nvme: write G; host: d2h G),
               micro-batches after the first fetch the sum so far (nvme: read G; host: h2d G).
    optimizer  nvme: read O and write O (steady state; the first step reads zeros for free)
               plus read G of the gradients it consumes; the step runs on the GPU when the
               optimizer state is on the device tier of a GPU, else on the CPU.

Note [step time]: forward/backward and the optimizer step are sequential phases.
Within a phase transfers overlap compute (prefetch, read ahead, write behind), so a
phase takes as long as its slowest resource; NVMe reads and writes share the disk:

    t_fb   = max(compute, disk_fb, h2d_fb, d2h_fb)        disk = read/nvme_read + write/nvme_write
    t_opt  = max(adam, disk_opt, h2d_opt, d2h_opt)         adam = elements / adam rate
    step   = t_fb + t_opt

Collectives (all-gather, reduce-scatter) cost the same under every placement and
are left out of the comparison.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .tier import Tier, params_alias_master

LINKS = ("nvme_read", "nvme_write", "h2d", "d2h")  # the keys of memory_report()["bytes_moved"]


@dataclass(frozen=True, kw_only=True)
class LinkRates:
    """Throughput of every resource a step uses. h2d / d2h are `math.inf` without a GPU (no copy)."""

    nvme_read: float  # bytes/s
    nvme_write: float  # bytes/s
    h2d: float = math.inf  # bytes/s
    d2h: float = math.inf  # bytes/s
    cpu_adam: float  # elements/s
    device_adam: float  # elements/s (== cpu_adam without a GPU)
    matmul_flops: float  # FLOP/s of the compute device
    source: str = "defaults"  # "measured <date> on <dir>" or "defaults"

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> "LinkRates":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (math.inf if v is None else v) for k, v in data.items() if k in names})


# Conservative rates used when nothing was measured yet (a SATA-class disk, a laptop CPU).
DEFAULT_RATES = LinkRates(nvme_read=1.0e9, nvme_write=0.8e9, h2d=12e9, d2h=12e9, cpu_adam=2.0e8,
                          device_adam=2.0e10, matmul_flops=5.0e10, source="defaults")


def default_rates(cuda: bool) -> LinkRates:
    if cuda:
        return DEFAULT_RATES
    return dataclasses.replace(DEFAULT_RATES, h2d=math.inf, d2h=math.inf, device_adam=DEFAULT_RATES.cpu_adam)


# ---------------------------------------------------------------- traffic


@dataclass
class StepTraffic:
    """Bytes per link in each phase of one optimizer step, and the Adam elements stepped where."""

    fb: dict[str, int] = dataclasses.field(default_factory=lambda: {k: 0 for k in LINKS})
    opt: dict[str, int] = dataclasses.field(default_factory=lambda: {k: 0 for k in LINKS})
    adam_cpu: int = 0  # elements stepped on the CPU
    adam_device: int = 0  # elements stepped on the GPU

    def add(self, other: "StepTraffic", sign: int = 1) -> None:
        for k in LINKS:
            self.fb[k] += sign * other.fb[k]
            self.opt[k] += sign * other.opt[k]
        self.adam_cpu += sign * other.adam_cpu
        self.adam_device += sign * other.adam_device

    def total(self) -> dict[str, int]:
        return {k: self.fb[k] + self.opt[k] for k in LINKS}


def unit_traffic(shard_numel: int, tiers: dict[str, Tier], *, compute_bytes: int, cuda: bool, accum: int,
                 is_root: bool, kept_numel: int | None = None) -> StepTraffic:
    """One unit's traffic per optimizer step (Note [traffic per step]); `tiers` maps group -> tier.
    `kept_numel`: parameter elements whose first fetch reads a kept copy (None: all of them)."""
    t = StepTraffic()
    P, G, O = shard_numel * compute_bytes, shard_numel * 4, shard_numel * 12
    fetches = accum * (1 if is_root else 2)
    params, grads, optim = tiers["params"], tiers["grads"], tiers["optimizer"]
    opt_on_gpu = cuda and optim is Tier.DEVICE
    # params: fetched for compute, written back after the step (as the master when aliased)
    if params is Tier.NVME:
        kept = shard_numel if kept_numel is None else kept_numel
        t.fb["nvme_read"] += fetches * P - kept * compute_bytes
        t.opt["nvme_write"] += 0 if params_alias_master(compute_bytes, params, optim) else P
    if cuda and params is not Tier.DEVICE:
        t.fb["h2d"] += fetches * P
    if cuda and (params is Tier.DEVICE) != opt_on_gpu:  # new params cross between where Adam ran and their tier
        t.opt["h2d" if params is Tier.DEVICE else "d2h"] += P
    # grads: stored every micro-batch, accumulated from the second on, read by the optimizer
    if grads is Tier.NVME:
        t.fb["nvme_write"] += accum * G
        t.fb["nvme_read"] += (accum - 1) * G
        t.opt["nvme_read"] += G
    if cuda and grads is not Tier.DEVICE:
        t.fb["d2h"] += accum * G
        t.fb["h2d"] += (accum - 1) * G
    if cuda and (grads is Tier.DEVICE) != opt_on_gpu:
        t.opt["d2h" if grads is Tier.DEVICE else "h2d"] += G
    # optimizer state: streamed through RAM when on NVMe
    if optim is Tier.NVME:
        t.opt["nvme_read"] += O
        t.opt["nvme_write"] += O
    if opt_on_gpu:
        t.adam_device += shard_numel
    else:
        t.adam_cpu += shard_numel
    return t


def plan_traffic(plan, *, cuda: bool, accum: int, kept: frozenset[tuple[int, int]] | None = None) -> StepTraffic:
    """The traffic of every unit of `plan` (unit 0 is the root) per optimizer step. `kept`: the (unit, chunk)s
    of parameters kept in memory after the update (None: all, as with deferred updates)."""
    total = StepTraffic()
    compute_bytes = plan.compute_dtype.itemsize
    for index, (sizes, kinds) in enumerate(zip(plan.units, plan.tiers)):
        tiers = {k.group: t for k, t in kinds.items()}
        kept_numel = None if kept is None else sum(n for c, n in enumerate(sizes.chunk_numels) if (index, c) in kept)
        total.add(unit_traffic(sizes.shard_numel, tiers, compute_bytes=compute_bytes, cuda=cuda, accum=accum,
                               is_root=index == 0, kept_numel=kept_numel))
    return total


# ---------------------------------------------------------------- time


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by phase and resource (Note [step time])."""

    compute: float
    fb: dict[str, float]  # seconds per resource in forward/backward: compute, disk, h2d, d2h
    opt: dict[str, float]  # seconds per resource in the optimizer step: adam, disk, h2d, d2h

    @property
    def fb_seconds(self) -> float:
        return max(self.fb.values())

    @property
    def opt_seconds(self) -> float:
        return max(self.opt.values())

    @property
    def total(self) -> float:
        return self.fb_seconds + self.opt_seconds

    @property
    def link_seconds(self) -> float:
        """Busy time of every transfer resource, summed (a tie-breaker: less traffic is better)."""
        return sum(v for k, v in self.fb.items() if k != "compute") + sum(
            v for k, v in self.opt.items() if k != "adam")

    def bottlenecks(self) -> tuple[str, str]:
        """The slowest resource of each phase."""
        return max(self.fb, key=self.fb.get), max(self.opt, key=self.opt.get)


def _seconds(num_bytes: float, rate: float) -> float:
    return 0.0 if num_bytes == 0 or math.isinf(rate) else num_bytes / rate


def predict_step_time(traffic: StepTraffic, rates: LinkRates, compute_seconds: float = 0.0) -> StepTime:
    """Note [step time] applied to `traffic`."""
    def links(phase: dict[str, int]) -> dict[str, float]:
        return {"disk": _seconds(phase["nvme_read"], rates.nvme_read) + _seconds(phase["nvme_write"], rates.nvme_write),
                "h2d": _seconds(phase["h2d"], rates.h2d), "d2h": _seconds(phase["d2h"], rates.d2h)}
    adam = traffic.adam_cpu / rates.cpu_adam + traffic.adam_device / rates.device_adam
    return StepTime(compute=compute_seconds, fb={"compute": compute_seconds, **links(traffic.fb)},
                    opt={"adam": adam, **links(traffic.opt)})


def compute_seconds(flops: float, rates: LinkRates, efficiency: float = 0.5) -> float:
    """Forward + backward time of `flops` FLOPs at `efficiency` of the measured matmul rate."""
    return flops / (rates.matmul_flops * efficiency)


def profile_peaks(rates: LinkRates | None) -> dict[str, float]:
    """Decimal GB/s per profiler link (`Link` values) from measured rates, for the profile summary's
    achieved-vs-peak; {} without a measurement. The CPU optimizer's bytes are 16 per element (master,
    gradient and both moments, fp32), as its spans count them."""
    if rates is None or rates.source == "defaults":
        return {}
    peaks = {"nvme_read": rates.nvme_read / 1e9, "nvme_write": rates.nvme_write / 1e9,
             "cpu_optimizer": rates.cpu_adam * 16 / 1e9}
    peaks.update({k: getattr(rates, k) / 1e9 for k in ("h2d", "d2h") if math.isfinite(getattr(rates, k))})
    return peaks
