"""Cost model of a training step: the predicted step time of a plan's traffic, and the link rates.

Link rates (measured and cached by `infinity.machine.link_rates`; this module only
computes with the rates it is given):

    nvme_read, nvme_write   io_engine throughput on the swap directory's disk (bytes/s)
    h2d, d2h                pinned host <-> GPU copies (bytes/s); free without a GPU
    cpu_adam                fused CPU Adam (elements/s); device_adam the same on the GPU
    matmul_flops            dense matmul throughput of the compute device (FLOP/s)

Bytes per link come from the byte model (memory/traffic.py, Note [traffic per step]).

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

from infinity.memory.traffic import LINKS, StepTraffic, activation_offload_traffic, plan_traffic, unit_traffic  # noqa: F401 - the byte model's, used here


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


def step_flops(traced_flops: float, unit_forward_flops: float, checkpoint: str) -> float:
    """Note [recompute]: one micro-batch's forward + backward FLOPs; with `[activation] checkpoint = "units"`
    every unit's forward runs again in backward (the root's is not checkpointed): about a third more."""
    return traced_flops + (unit_forward_flops if checkpoint == "units" else 0.0)


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
