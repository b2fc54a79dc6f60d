"""`infinity estimate --stages` and `--world N --nodes M`: every ZeRO stage of a run, on paper.

For the configured model, placement and world size, each stage (memory/stages.py) is planned exactly as
`initialize` plans it (`plan_for_config` over the units `estimate.unit_sizes_of` builds at that stage),
so a rank's state bytes per tier are the engine's byte model (`Plan.state_bytes`, Note [state bytes]),
whether it fits is the planner's own check (a `PlacementError` or not), and the bytes per PCIe and NVMe
link are the plan's traffic (Note [traffic per step]). The collectives add what `Stage.comm_elements`
says a rank sends (stages 0-2 2Ψ, stage 3 3Ψ), split over the intra- and inter-node networks by
Note [link model]. Nothing is launched or allocated: the model is built on the meta device.

A step's time per stage follows Note [step time] (memory/cost_model.py) with the two network links
added as resources of forward/backward (where every collective runs), at the rates of a `Hardware`: a preset
(`HARDWARE`, the assumptions docs/scaling.md states) or this machine's measured rates (no network rates:
its collectives are counted in bytes, not in time).

Note [link model]: a cluster of N ranks on M nodes, G = N / M ranks per node, runs each reduce-scatter
and all-gather hierarchically (as NCCL does across nodes): for a buffer of B bytes (the whole, unsharded
buffer), a reduce-scatter first reduce-scatters over the G ranks of a node (a ring: each rank sends
(G-1)/G * B over the intra-node network, NVLink), then each rank reduce-scatters its B/G slice with the
ranks holding the same slice on the other M-1 nodes (a ring over M: it sends (M-1)/M * B/G over the
inter-node network); an all-gather is the same in reverse, an all-reduce one of each. So per collective

    intra-node, per rank    (G-1)/G * B       over that rank's NVLink
    inter-node, per node    (M-1)/M * B       over the node's network adapters together (G ranks * B/G)

With M = 1 nothing crosses nodes; with N = 1 nothing is sent. B counts the elements of `comm_parts`
at their dtype: gradients reduce in fp32, parameters gather in the compute dtype. Ψ is every parameter
of the model (frozen ones are gathered too, and a LoRA run reduces fewer gradients than counted here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from infinity.config.sections import Config, ConfigError
from infinity.device.dtypes import dtype_of
from infinity.memory import cost_model
from infinity.memory.placement import plan_for_config
from infinity.memory.plan import Budgets, PlacementError, Plan, overflows
from infinity.memory.stages import STAGES, stage_for
from infinity.memory.tier import Tier
from infinity.plan.estimate import Trace, resolve_budgets_for, trace_step, unit_sizes_of
from io_engine import format_size

NETWORK = ("intra_node", "inter_node")
LINK_NAMES = cost_model.LINKS + NETWORK  # nvme_read, nvme_write, h2d, d2h, intra_node, inter_node
UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Cluster:
    """N ranks on M nodes, the same number on each."""

    world_size: int
    nodes: int = 1

    def __post_init__(self):
        if self.world_size < 1 or self.nodes < 1 or self.world_size % self.nodes:
            raise ConfigError(f"--world-size {self.world_size} over --nodes {self.nodes}: every node runs the same "
                              f"number of ranks; give a world size that is a multiple of the node count")

    @property
    def per_node(self) -> int:
        return self.world_size // self.nodes


def network_bytes(buffer_bytes: int, cluster: Cluster) -> dict[str, int]:
    """Note [link model]: the bytes one reduce-scatter or all-gather of a `buffer_bytes` buffer sends over
    the intra-node network from one rank ("intra_node") and over the inter-node network from one node
    ("inter_node"), collectives run hierarchically (a ring within each node, then a ring across nodes
    per slice)."""
    g, m = cluster.per_node, cluster.nodes
    return {"intra_node": buffer_bytes * (g - 1) // g, "inter_node": buffer_bytes * (m - 1) // m}


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One node's resources (decimal bytes/s, each direction) and memory; what docs/scaling.md assumes."""

    name: str
    gpus_per_node: int
    device_bytes: int  # memory per GPU
    host_bytes: int  # RAM per node
    nvme_bytes: int  # NVMe capacity per node
    pcie: float  # per GPU, each direction (h2d, d2h)
    nvme_read: float  # per node, all drives together
    nvme_write: float
    nvlink: float | None  # per GPU, each direction (the intra-node network)
    network: float | None  # per node, all adapters together, each direction (the inter-node network)
    flops: float  # dense half-precision matmul FLOP/s per GPU (compute takes half of it: cost_model)
    cpu_adam: float  # Adam elements/s per node, all cores
    device_adam: float = 5.0e10  # Adam elements/s per GPU
    note: str = ""

    def rank_rates(self, per_node: int) -> cost_model.LinkRates:
        """The rates one rank gets when `per_node` ranks share the node's disks and CPUs."""
        return cost_model.LinkRates(nvme_read=self.nvme_read / per_node, nvme_write=self.nvme_write / per_node,
                                    h2d=self.pcie, d2h=self.pcie, cpu_adam=self.cpu_adam / per_node,
                                    device_adam=self.device_adam, matmul_flops=self.flops, source=self.name)

    def budgets(self, config: Config, per_node: int) -> Budgets:
        """A rank's budgets on this hardware; `memory.*_budget` set to a size wins over the preset, as does
        `memory.activation_reserve` over the traced activations."""
        mem = config.memory
        device = self.device_bytes if mem.device_budget == "auto" else int(mem.device_budget)
        host = self.host_bytes // per_node if mem.host_budget == "auto" else int(mem.host_budget)
        return Budgets(device=device, host=host, nvme=self.nvme_bytes // per_node,
                       activations=mem.reserved_activations)


G, T = 10**9, 10**12
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware(name="dgx2", gpus_per_node=16, device_bytes=32 * G, host_bytes=1500 * G, nvme_bytes=30 * T,
             pcie=12 * G, nvme_read=25 * G, nvme_write=20 * G, nvlink=150 * G, network=100 * G, flops=125 * T,
             cpu_adam=5.0e9, device_adam=2.0e10,
             note="ZeRO-Infinity's DGX-2: 16 x V100 32 GB, PCIe 3 x16, NVSwitch, 8 x 100 Gb/s InfiniBand"),
    Hardware(name="dgx-h100", gpus_per_node=8, device_bytes=80 * G, host_bytes=2000 * G, nvme_bytes=30 * T,
             pcie=50 * G, nvme_read=50 * G, nvme_write=25 * G, nvlink=450 * G, network=400 * G, flops=989 * T,
             cpu_adam=1.0e10, device_adam=1.0e11,
             note="8 x H100 80 GB, PCIe 5 x16, NVLink 4, 8 x 400 Gb/s InfiniBand, 8 Gen4 NVMe drives"),
)}


@dataclass
class StageRow:
    """One stage of the configured run, for one rank."""

    stage: int
    name: str
    state: dict[Tier, int] | None  # state bytes per tier (None: the auto policy found no plan)
    fits: bool
    error: str | None  # the planner's message when it does not fit
    comm_elements: int  # sent per step by one rank (Stage.comm_elements)
    comm_bytes: int
    links: dict[str, int] = field(default_factory=dict)  # bytes per step: per rank (PCIe, NVMe) + NETWORK
    link_bytes: dict[str, int] = field(default_factory=dict)  # per physical link: PCIe / NVLink per GPU, NVMe and
    #                                                           inter-node per node
    step_time: cost_model.StepTime | None = None

    def to_json(self) -> dict:
        st = self.step_time
        return {"stage": self.stage, "name": self.name, "fits": self.fits, "error": self.error,
                "state": None if self.state is None else {t.value: v for t, v in self.state.items()},
                "comm_elements": self.comm_elements, "comm_bytes": self.comm_bytes, "bytes_per_rank": self.links,
                "bytes_per_link": self.link_bytes,
                "step_time": None if st is None else {"total_s": st.total, "forward_backward": st.fb,
                                                      "optimizer": st.opt, "bound_by": st.bottlenecks()}}


@dataclass
class StageReport:
    """`infinity estimate --stages`: every stage of the configured run on `cluster`."""

    cluster: Cluster
    hardware: Hardware | None
    num_params: int
    placement: str
    budgets: Budgets
    rates: cost_model.LinkRates
    trace: Trace
    compute_s: float
    rows: list[StageRow]

    def to_json(self) -> dict:
        return {"world_size": self.cluster.world_size, "nodes": self.cluster.nodes,
                "hardware": dataclasses.asdict(self.hardware) if self.hardware else None,
                "num_params": self.num_params, "placement": self.placement,
                "budgets": dataclasses.asdict(self.budgets), "rates": self.rates.to_json(),
                "flops_per_step": self.trace.flops, "compute_s": self.compute_s,
                "stages": [r.to_json() for r in self.rows]}


# ---------------------------------------------------------------- the estimate


def stage_row(stage: int, sizes, config: Config, budgets: Budgets, cluster: Cluster, num_params: int, *,
              cuda: bool, rates: cost_model.LinkRates, compute_s: float, network: dict[str, float | None],
              activations: dict[str, int] | None = None) -> StageRow:
    """Plan `sizes` (the units at `stage`) as `initialize` would, and price its step on `cluster`."""
    st = stage_for(stage)
    accum = config.train.grad_accum_steps
    csize = dtype_of(config.precision.compute_dtype).itemsize
    reduced, gathered = st.comm_parts(num_params, cluster.world_size, accum)
    row = StageRow(stage=stage, name=st.name, state=None, fits=True, error=None,
                   comm_elements=reduced + gathered, comm_bytes=reduced * 4 + gathered * csize)
    plan: Plan | None = None
    try:  # tail units leave the activations (Note [tail units])
        plan = plan_for_config(sizes, config, budgets.reserving(activations["device"]) if activations else budgets,
                               rates=rates)
    except (PlacementError, ConfigError) as e:  # ConfigError: an explicit read-ahead that does not fit
        row.fits, row.error = False, str(e)
        if config.placement.policy == "static":  # its bytes all the same: the same tiers, no budget, and no
            # tail units: "auto" takes them within the device's room, unlimited here (a 70B at stage 0 had 824 GiB)
            unlimited = dataclasses.replace(budgets, device=UNLIMITED, host=UNLIMITED, nvme=UNLIMITED, ram=None)
            own = config if config.placement.tail_units != "auto" else dataclasses.replace(
                config, placement=dataclasses.replace(config.placement, tail_units=0))
            plan = plan_for_config(sizes, own, unlimited, rates=rates)
    if plan is None:
        return row
    if row.fits and activations:  # Note [estimate table]: the activations count in "fits"
        totals = plan.tier_totals()
        totals[Tier.DEVICE] += activations["device"]
        totals[Tier.HOST] += activations["host"]
        over = overflows(totals, budgets)
        if over:
            row.fits, row.error = False, "with activations (" + format_size(activations["device"], exact=False) \
                + " on device): " + "; ".join(over.values())
    row.state = {t: sum(kinds.values()) for t, kinds in plan.state_bytes().items()}
    traffic = cost_model.plan_traffic(plan, cuda=cuda, accum=accum)
    # every collective runs in forward/backward: the reductions in backward, stage 3's gathers before each use,
    # stages 1-2's gathers of the updated partitions at the unit's first unshard after its update
    net = network_bytes(row.comm_bytes, cluster)
    g = cluster.per_node
    row.links = {**traffic.total(), "intra_node": net["intra_node"], "inter_node": net["inter_node"] // g}
    row.link_bytes = {"h2d": row.links["h2d"], "d2h": row.links["d2h"], "nvme_read": row.links["nvme_read"] * g,
                      "nvme_write": row.links["nvme_write"] * g, **net}
    base = cost_model.predict_step_time(traffic, rates, compute_s, units_ahead=config.prefetch.units_ahead)
    # the rank's NVLink bytes over its rate; the node's network bytes over the node's rate
    seconds = {k: net[k] / network[k] if network.get(k) and net[k] else 0.0 for k in NETWORK}
    row.step_time = cost_model.StepTime(compute=base.compute, fb={**base.fb, **seconds}, opt=base.opt,
                                        on_demand=base.on_demand)
    return row


def estimate_stages(make_model: Callable, config: Config, cluster: Cluster, *, hardware: Hardware | None = None,
                    batch_size: int = 1, seq_len: int = 128, trace: bool = True, cuda: bool | None = None,
                    budgets: Budgets | None = None) -> StageReport:
    """Every stage (0-3) of `config`'s run of `make_model()` on `cluster`, for one rank.

    `hardware`: a preset's budgets and rates (`HARDWARE`); None: this machine (budgets resolved and link
    rates cached as `infinity estimate` does; no network rates). `batch_size` sequences per micro-batch on
    one rank. `trace`: trace a forward + backward on meta tensors for the FLOPs; without it (a model too
    large to trace quickly) compute counts 6 FLOPs per parameter and token.
    """
    import torch
    bundle = make_model()
    params = {id(p): p for p in bundle.model.parameters()}.values()
    num_params = sum(p.numel() for p in params)
    g = cluster.per_node
    if hardware is not None:
        cuda = True
        rates = hardware.rank_rates(g)
        budgets = budgets or hardware.budgets(config, g)
        network = {"intra_node": hardware.nvlink, "inter_node": hardware.network}
    else:
        from infinity.machine.link_rates import cached_link_rates
        from infinity.machine.preflight import check_disks
        cuda = torch.cuda.is_available() if cuda is None else cuda
        rates = cached_link_rates(cuda)
        if budgets is None:
            _, nvme_free = check_disks(list(config.nvme.paths), nvme_bytes=0, local_world_size=g,
                                       headroom=config.memory.headroom)
            budgets = resolve_budgets_for(config, local_world_size=g, cuda=cuda, nvme_free=nvme_free,
                                          check_machine=cluster.world_size == 1)
        network = {}
    accum = config.train.grad_accum_steps
    traced = Trace()
    if trace:
        from infinity.device.dtypes import dtype_of
        from infinity.runtime.chunked_loss import kept_whole, loss_forward
        from infinity.units.builder import activation_modules
        from infinity.units.tiling import tile_layers
        copy = make_model()  # tracing moves its buffers to the meta device
        tile_layers(copy.model, config.units.tile_bytes, dtype_of(config.precision.compute_dtype).itemsize,
                    keep=kept_whole(loss_forward(config.activation, copy.model)))  # as initialize
        traced = trace_step(copy.model, copy.loss, batch_size, seq_len,  # (a split block's activations: whole)
                            [m for _, m in activation_modules(copy.model, list(config.units.classes))])
    from infinity.plan.estimate import activation_terms
    acts = activation_terms(traced, config.activation)
    activations = {"device": acts["saved"] + acts["recompute"] + traced.largest_saved_bytes, "host": acts["host"]}
    work = traced.step_work("none") if traced.flops else cost_model.Work(flops=6.0 * num_params * batch_size * seq_len)
    compute_s = cost_model.compute_seconds(work.times(accum), rates)
    rows = []
    for stage in STAGES:
        staged = config.with_overrides([f"zero.stage={stage}"])
        sizes = unit_sizes_of(bundle.model, staged, cluster.world_size)
        rows.append(stage_row(stage, sizes, staged, budgets, cluster, num_params, cuda=cuda, rates=rates,
                              compute_s=compute_s, network=network, activations=activations))
    p = config.placement
    placement = "auto" if p.policy == "auto" else f"params={p.params} grads={p.grads} optimizer={p.optimizer}"
    return StageReport(cluster=cluster, hardware=hardware, num_params=num_params, placement=placement,
                       budgets=budgets, rates=rates, trace=traced, compute_s=compute_s, rows=rows)


# ---------------------------------------------------------------- text


def _fmt(n: float | None) -> str:
    return "-" if n is None else format_size(n, exact=False)


def _count(n: int) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms" if s < 10 else f"{s:,.1f} s"


def format_stages(rep: StageReport) -> str:
    """The text of `infinity estimate --stages`."""
    c, hw = rep.cluster, rep.hardware
    lines = [f"model: {_count(rep.num_params)} parameters; world size {c.world_size} = {c.nodes} node(s) x "
             f"{c.per_node} rank(s); placement {rep.placement}",
             f"hardware: {hw.name} ({hw.note})" if hw else f"hardware: this machine (link rates: {rep.rates.source})",
             f"budgets per rank: device {_fmt(rep.budgets.device)}, host {_fmt(rep.budgets.host)}, "
             f"nvme {_fmt(rep.budgets.nvme)}", "",
             "state bytes per rank and tier (the engine's byte model), the planner's fit, collectives per step:",
             f"  {'stage':9}{'device':>11}{'host':>11}{'nvme':>11}{'total':>11}  {'fits':5}{'comm elements':>16}"
             f"{'comm bytes':>12}"]
    for r in rep.rows:
        state = r.state or {}
        cells = [state.get(t) for t in Tier] + [sum(state.values()) if state else None]
        lines.append(f"  {r.stage} {r.name:7}" + "".join(f"{_fmt(v):>11}" for v in cells)
                     + f"  {'yes' if r.fits else 'no':5}{r.comm_elements:>16,}{_fmt(r.comm_bytes):>12}")
    for r in rep.rows:
        if r.error:
            lines.append(f"  stage {r.stage} does not fit: {r.error}")
    lines += ["", "bytes per step and link (PCIe and NVLink per GPU; NVMe and inter-node network per node; "
              "Note [link model]):",
              f"  {'stage':9}" + "".join(f"{k:>12}" for k in LINK_NAMES)]
    for r in rep.rows:
        if r.link_bytes:
            lines.append(f"  {r.stage} {r.name:7}" + "".join(f"{_fmt(r.link_bytes[k]):>12}" for k in LINK_NAMES))
    flops = f"{rep.trace.flops / 1e9:,.1f} GFLOP traced" if rep.trace.flops else "6 FLOPs per parameter and token"
    lines += ["", f"predicted step per stage (Note [step time]; compute {_ms(rep.compute_s)}: {flops} per micro-batch "
              f"at half of {rep.rates.matmul_flops / 1e12:,.1f} TFLOP/s):"]
    for r in rep.rows:
        st = r.step_time
        if st is None:
            continue
        fb, opt = st.bottlenecks()
        busy = ", ".join(f"{k} {_ms(v)}" for k, v in {**st.fb, **{f'opt {k}': v for k, v in st.opt.items()}}.items()
                         if v > 0)
        lines.append(f"  {r.stage} {r.name:7} {_ms(st.total):>10} = forward/backward {_ms(st.fb_seconds)} "
                     f"(bound by {fb}) + optimizer {_ms(st.opt_seconds)} (bound by {opt});  {busy}")
    if not rep.hardware and c.world_size > 1:
        lines.append("  (no network rates for this machine: collectives are counted in bytes, not time; "
                     "--hardware NAME prices them)")
    if rep.trace.error:
        lines.append(f"  not traced: {rep.trace.error}")
    return "\n".join(lines)
