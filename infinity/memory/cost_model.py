"""Cost model of a training step: the predicted step time of a plan's traffic, and the link rates.

Link rates (measured and cached by `infinity.machine.link_rates`; this module only
computes with the rates it is given):

    nvme_read, nvme_write   io_engine throughput on the swap directory's disk (bytes/s)
    h2d, d2h                pinned host <-> GPU copies (bytes/s); free without a GPU
    cpu_adam                fused CPU Adam (elements/s); device_adam the same on the GPU
    matmul_flops            dense matmul throughput of the compute device (FLOP/s)
    memory_bw               an elementwise operation's bytes read and written per second on the compute device
    op_seconds              the host's seconds per operation of a model's forward and backward (autograd's, the
                            dispatch, a kernel's launch): the estimate's runtime probe measures it

Bytes per link come from the byte model (memory/traffic.py, Note [traffic per step]).

Note [step time]: forward/backward and the optimizer step are sequential phases.
Within a phase transfers overlap compute (prefetch, read ahead, write behind), so a
phase takes as long as its slowest resource; NVMe reads and writes share the disk:

    t_fb   = max(compute, disk_fb, h2d_fb, d2h_fb)        disk = read/nvme_read + write/nvme_write
             (compute + max(disk_fb, h2d_fb, d2h_fb) with `prefetch.units_ahead = 0`: each unit is fetched
             on demand, when it runs; measured 2026-11-28, RESULTS D32: a 13B LoRA whose frozen weights are
             read from disk so, 1.97x the overlapped prediction)
    t_opt  = max(adam, disk_opt, h2d_opt, d2h_opt)         adam = elements / adam rate (on the CPU, a
                                                             16-bit state's elements count CPU_UPDATE_COST
                                                             times: traffic.py)
    step   = t_fb + t_opt

Collectives (all-gather, reduce-scatter) cost the same under every placement and
are left out of the comparison.

Note [compute time]: a forward + backward's compute is priced from its traced `Work` (plan/traced.py): the
FLOPs of the operations with a FLOP formula (matmuls, attention) at MATMUL_EFFICIENCY of the measured matmul
rate, the bytes every other operation reads and writes (elementwise, norms, softmax, the loss; a view moves
none) at the measured elementwise rate, and each operation at the host's measured cost of one:

    CPU    compute = flops / (matmul_flops * efficiency) + bytes / memory_bw + ops * op_seconds
    GPU    compute = max(flops / (matmul_flops * efficiency) + bytes / memory_bw, ops * op_seconds)

(a GPU's kernels queue behind the host's dispatch: the slower of the two paces the step). The FLOPs alone at
half the matmul rate missed both ways on a 2-core CPU (2026-11-28, benchmarks/bench_compute_time.py, plain
PyTorch forward + backward of seven GPTs from 2 x 16 to 6 x 512, 1.4 ms to 1.1 s): measured / predicted 0.49-88
(a 2 x 64 GPT's ~300 operations cost more than its matmuls; the large ones ran at twice half the rate). Priced
as above, with the rates measured in the same runs (135-148 GFLOP/s on 1024 x 1024, 25-27 GB/s for an fp32 add,
8.8-9.3 us per operation of the probe's 2 x 16 GPT), two runs gave 0.94-1.59 for the six larger shapes and
0.55-0.72 for the 2 x 16 GPT itself, whose time is all its operations' (their cost varies by process). On a GPU
the efficiency stays at half, unmeasured.
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
    memory_bw: float = math.inf  # bytes/s an elementwise operation reads and writes (inf: not priced)
    op_seconds: float = 0.0  # the host's seconds per operation (Note [compute time]; 0: not priced)
    source: str = "defaults"  # "measured <date> on <dir>" or "defaults"

    @property
    def on_gpu(self) -> bool:
        """Rates of a GPU (host <-> device copies cost time only with one)."""
        return not math.isinf(self.h2d)

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> "LinkRates":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (math.inf if v is None else v) for k, v in data.items() if k in names})


# Conservative rates used when nothing was measured yet (a SATA-class disk, a laptop CPU).
DEFAULT_RATES = LinkRates(nvme_read=1.0e9, nvme_write=0.8e9, h2d=12e9, d2h=12e9, cpu_adam=2.0e8,
                          device_adam=2.0e10, matmul_flops=5.0e10, memory_bw=3.0e11, source="defaults")
MATMUL_EFFICIENCY = {"cpu": 1.0, "gpu": 0.5}  # the measured matmul rate a model reaches (Note [compute time])


@dataclass(frozen=True)
class Work:
    """What a forward + backward computes (Note [compute time]): the FLOPs of the operations with a FLOP formula,
    the bytes the others read and write, the operations run."""

    flops: float = 0.0
    bytes: float = 0.0
    ops: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.bytes + other.bytes, self.ops + other.ops)

    def __sub__(self, other: "Work") -> "Work":
        return Work(self.flops - other.flops, self.bytes - other.bytes, self.ops - other.ops)

    def times(self, n: float) -> "Work":
        """`n` of it (a step's micro-batches)."""
        return Work(self.flops * n, self.bytes * n, self.ops * n)

    def per_batch(self, scale: float) -> "Work":
        """At `scale` times the micro-batch: FLOPs and bytes scale with it, the operations run do not."""
        return Work(self.flops * scale, self.bytes * scale, self.ops)


def default_rates(cuda: bool) -> LinkRates:
    if cuda:
        return DEFAULT_RATES
    return dataclasses.replace(DEFAULT_RATES, h2d=math.inf, d2h=math.inf, device_adam=DEFAULT_RATES.cpu_adam,
                               memory_bw=1.0e10)


# ---------------------------------------------------------------- time


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by phase and resource (Note [step time])."""

    compute: float
    fb: dict[str, float]  # seconds per resource in forward/backward: compute, disk, h2d, d2h
    opt: dict[str, float]  # seconds per resource in the optimizer step: adam, disk, h2d, d2h
    on_demand: bool = False  # `prefetch.units_ahead = 0`: each unit is fetched when it runs, not beside the compute

    @property
    def fb_seconds(self) -> float:
        if self.on_demand:  # (the fetches wait for the compute before them, and it for them)
            return self.fb["compute"] + max((v for k, v in self.fb.items() if k != "compute"), default=0.0)
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


def predict_step_time(traffic: StepTraffic, rates: LinkRates, compute_seconds: float = 0.0, *,
                      units_ahead: int = 1) -> StepTime:
    """Note [step time] applied to `traffic`; `units_ahead` (`prefetch.units_ahead`): 0 fetches on demand."""
    def links(phase: dict[str, int]) -> dict[str, float]:
        return {"disk": _seconds(phase["nvme_read"], rates.nvme_read) + _seconds(phase["nvme_write"], rates.nvme_write),
                "h2d": _seconds(phase["h2d"], rates.h2d), "d2h": _seconds(phase["d2h"], rates.d2h)}
    adam = traffic.adam_cpu_work / rates.cpu_adam + traffic.adam_device / rates.device_adam
    return StepTime(compute=compute_seconds, fb={"compute": compute_seconds, **links(traffic.fb)},
                    opt={"adam": adam, **links(traffic.opt)}, on_demand=units_ahead == 0)


def step_work(traced: Work, unit_forward: Work, checkpoint: str) -> Work:
    """Note [recompute]: one micro-batch's forward + backward; with `[activation] checkpoint = "units"` every unit's
    forward runs again in backward (the root's is not checkpointed): about a third more."""
    return traced + unit_forward if checkpoint == "units" else traced


def compute_seconds(work: Work, rates: LinkRates) -> float:
    """Note [compute time]: the forward + backward time of `work` at `rates`."""
    matmul = rates.matmul_flops * MATMUL_EFFICIENCY["gpu" if rates.on_gpu else "cpu"]
    kernels = work.flops / matmul + work.bytes / rates.memory_bw
    dispatch = work.ops * rates.op_seconds
    return max(kernels, dispatch) if rates.on_gpu else kernels + dispatch


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
