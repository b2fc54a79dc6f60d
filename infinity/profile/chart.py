"""Timeline chart: one lane per link, a bar per span, step boundaries marked.

Compute is the top lane; red bars on it are the waits (compute blocked on a
link), gray ones the training thread's host code, and a thin red strip under a link's lane marks the waits
on that link.
The title gives the median step time and overlap efficiency; each lane's
label its median achieved bandwidth. Needs matplotlib (drawn without pyplot,
so no global state and no display); without it nothing is drawn.
"""

from __future__ import annotations

from infinity.profile.records import Link, Span, SpanKind, StepMark
from infinity.profile.summary import parts_text

_COLORS = {
    Link.COMPUTE: "#4c72b0",
    Link.NVME_READ: "#55a868",
    Link.NVME_WRITE: "#8fd18f",
    Link.H2D: "#dd8452",
    Link.D2H: "#f2b880",
    Link.ALL_GATHER: "#8172b3",
    Link.REDUCE_SCATTER: "#b4a7e0",
    Link.ALL_REDUCE: "#6a5aa0",
    Link.CPU_OPTIMIZER: "#937860",
}
_WAIT_COLOR = "#c44e52"
_HOST_COLOR = "#9e9e9e"
_UNATTRIBUTED_COLOR = "#222222"


def _lane_label(link: Link, median: dict | None) -> str:
    if link is Link.COMPUTE or median is None or link.value not in median["links"]:
        return link.value
    stats = median["links"][link.value]
    label = link.value if stats["GBps"] is None else f"{link.value}\n{stats['GBps']:.2f} GB/s"
    if stats["fraction_of_peak"] is not None:
        label += f" ({stats['fraction_of_peak']:.0%} of peak)"
    return label


def _title(summary: dict) -> str:
    median = summary["median"]
    if median is None:
        return f"rank {summary['rank']}: nothing recorded"
    efficiency = median["overlap_efficiency"]
    efficiency_text = "-" if efficiency is None else f"{efficiency:.0%}"
    return (
        f"rank {summary['rank']}: median of {summary['num_steps']} steps, overlap efficiency {efficiency_text}, "
        f"host syncs {median['host_syncs']:g}/step"
        + ("" if median.get("host_syncs_training") is None else f" ({median['host_syncs_training']:g} training thread)")
        + "\n" + parts_text(median).replace(" + host", "\n+ host", 1)
    )


_PHASE_COLORS = {"forward": "#64b5cd", "backward": "#2a6f97", "optimizer": "#937860", "checkpoint": "#da8bc3"}


def _phase(name: str) -> str | None:
    """The phase of a compute span, from its name ("forward before blocks.0", "backward", "update <root>",
    "checkpoint ..."); None for anything else."""
    word = name.split(" ", 1)[0]
    if word in ("forward", "backward", "checkpoint"):
        return word
    if word in ("update", "adam", "step", "optimizer"):
        return "optimizer"
    return None


DETAIL_STEPS = 3  # Note [readable timeline]: the steps drawn span by span


def _waits_by_unit(spans: list[Span]) -> list[tuple[str, float]]:
    """Exposed wait seconds per unit (or the wait's name when it names no unit), largest first."""
    total: dict[str, float] = {}
    for s in spans:
        if s.kind is SpanKind.WAIT:
            key = s.unit or s.name
            total[key] = total.get(key, 0.0) + s.end - s.start
    return sorted(total.items(), key=lambda kv: -kv[1])


def draw_timeline(spans: list[Span], steps: list[StepMark], summary: dict, path: str) -> bool:
    """Write the chart as a PNG to `path`; False (nothing written) without matplotlib.

    Note [readable timeline]: readable at any run length: (1) the last `DETAIL_STEPS` steps span by span,
    a phase band (forward / backward / optimizer / checkpoint, from the compute spans' names),
    one lane per link, step boundaries as thin lines labelled once; (2) the whole run as a per-step strip,
    the step's parts stacked per step (compute, exposed, host, unattributed: Note [step attribution]), the
    exposed wait again on its own scale; (3) exposed wait per unit over the run, largest first."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False

    links = [Link.COMPUTE] + [link for link in Link if link is not Link.COMPUTE and any(s.link is link for s in spans)]
    detail = sorted(steps, key=lambda m: m.begin)[-DETAIL_STEPS:]
    begin = detail[0].begin if detail else min((s.start for s in spans), default=0.0)
    end = detail[-1].end if detail else max((s.end for s in spans), default=1.0)
    shown = [s for s in spans if s.end >= begin and s.start <= end]
    waits = _waits_by_unit(spans)[:10]
    figure = Figure(figsize=(12, 2.0 + 0.7 * len(links) + 2.2 + 0.25 * max(len(waits), 2)))
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(3, 1, height_ratios=[1.2 + 0.7 * len(links), 2.2, 0.6 + 0.25 * max(len(waits), 2)])
    axes = figure.add_subplot(grid[0])

    for lane, link in enumerate(links):
        y = len(links) - 1 - lane  # compute on top
        if link is Link.COMPUTE:  # the training thread's host code (Note [step attribution]), under its compute
            host = [(s.start - begin, s.end - s.start) for s in shown if s.kind is SpanKind.HOST]
            axes.broken_barh(host, (y - 0.35, 0.7), facecolors=_HOST_COLOR, linewidth=0)
        work = [(s.start - begin, s.end - s.start) for s in shown if s.link is link and s.kind is SpanKind.WORK]
        axes.broken_barh(work, (y - 0.35, 0.7), facecolors=_COLORS[link], linewidth=0)
        lane_waits = [(s.start - begin, s.end - s.start) for s in shown
                      if s.kind is SpanKind.WAIT and (s.link is link or link is Link.COMPUTE)]
        height = 0.35 if link is Link.COMPUTE else 0.12
        axes.broken_barh(lane_waits, (y - 0.35, height), facecolors=_WAIT_COLOR, linewidth=0)

    y = len(links) - 0.55  # the phase band, above the compute lane
    for phase, color in _PHASE_COLORS.items():
        bars = [(s.start - begin, s.end - s.start) for s in shown
                if s.link in (Link.COMPUTE, Link.CPU_OPTIMIZER) and _phase(s.name) == phase]
        axes.broken_barh(bars, (y, 0.12), facecolors=color, linewidth=0)
        axes.plot([], [], color=color, linewidth=6, label=f"phase: {phase}")
    for mark in detail:
        axes.axvline(mark.begin - begin, color="0.5", linewidth=0.6)
        axes.text(mark.begin - begin, len(links) - 0.45, f" step {mark.step}", fontsize=8, va="bottom")
    axes.set_xlim(0, max(end - begin, 1e-6))
    axes.set_yticks(range(len(links)), [_lane_label(link, summary["median"]) for link in reversed(links)], fontsize=8)
    axes.set_ylim(-0.6, len(links) - 0.1 + 0.3)
    axes.set_xlabel(f"seconds (the last {len(detail)} step(s) in detail)")
    axes.set_title(_title(summary))
    axes.plot([], [], color=_WAIT_COLOR, linewidth=6, label="waiting on a link (exposed)")
    axes.plot([], [], color=_HOST_COLOR, linewidth=6, label="host code (hooks, engine, caller)")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)

    strip = figure.add_subplot(grid[1])
    rows = [r for r in summary.get("steps", []) if r.get("step") is not None]
    numbers = [r["step"] for r in rows]
    compute = [(r["compute_s"] or 0.0) * 1e3 for r in rows]
    exposed = [(r["exposed_s"] or 0.0) * 1e3 for r in rows]
    host = [(r["host_s"] or 0.0) * 1e3 for r in rows]
    unattributed = [(r["unattributed_s"] or 0.0) * 1e3 for r in rows]
    bottom = [0.0] * len(rows)  # the step's parts stacked: they add up to the step (Note [step attribution])
    for values, color, label in ((compute, _COLORS[Link.COMPUTE], "compute"), (exposed, _WAIT_COLOR, "exposed"),
                                 (host, _HOST_COLOR, "host"), (unattributed, _UNATTRIBUTED_COLOR, "unattributed")):
        strip.bar(numbers, values, bottom=bottom, width=1.0, color=color, label=f"{label} (left, ms)", linewidth=0)
        bottom = [b + v for b, v in zip(bottom, values)]
    totals = sorted(bottom)
    if totals:  # a slow first step (warm-up) would flatten the rest: clip at 1.5x the 95th percentile
        top = 1.5 * totals[min(len(totals) - 1, int(0.95 * len(totals)))]
        strip.set_ylim(0, max(top, 1e-3))
    strip.set_ylabel("ms per step", fontsize=8)
    wait_axis = strip.twinx()  # the exposed wait on its own scale: a few percent of the step stays visible
    wait_axis.bar(numbers, exposed, width=0.6, color=_WAIT_COLOR, label="exposed wait (right, ms)", linewidth=0)
    wait_axis.set_ylim(0, max(max(exposed, default=0.0) * 1.1, 1e-3) * 3)  # the lowest third of the strip
    wait_axis.set_ylabel("exposed wait ms", fontsize=8, color=_WAIT_COLOR)
    wait_axis.legend(loc="upper left", fontsize=8)
    strip.set_xlabel("step (the whole run)")
    strip.set_title("every step: compute + exposed + host + unattributed = the step; exposed again on its own "
                    "scale", fontsize=9)
    strip.legend(loc="upper right", fontsize=8)

    bars = figure.add_subplot(grid[2])
    names = [name for name, _ in waits] or ["no waits"]
    bars.barh(range(len(names)), [sec * 1e3 for _, sec in waits] or [0.0], color=_WAIT_COLOR)
    bars.set_yticks(range(len(names)), names, fontsize=7)
    bars.invert_yaxis()
    bars.set_xlabel("exposed wait over the run, ms (by unit)", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True
