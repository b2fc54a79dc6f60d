"""Timeline chart: one lane per link, a bar per span, step boundaries marked.

Compute is the top lane; red bars on it are the waits (compute blocked on a
link), and a thin red strip under a link's lane marks the waits on that link.
The title gives the median step time and overlap efficiency; each lane's
label its median achieved bandwidth. Needs matplotlib (drawn without pyplot,
so no global state and no display); without it nothing is drawn.
"""

from __future__ import annotations

from infinity.profile.records import Link, Span, SpanKind, StepMark

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
        f"rank {summary['rank']}: step {median['step_s'] * 1e3:.1f} ms (median of {summary['num_steps']}), "
        f"overlap efficiency {efficiency_text}"
    )


def draw_timeline(spans: list[Span], steps: list[StepMark], summary: dict, path: str) -> bool:
    """Write the chart as a PNG to `path`; False (nothing written) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False

    links = [Link.COMPUTE] + [link for link in Link if link is not Link.COMPUTE and any(s.link is link for s in spans)]
    times = [s.start for s in spans] + [m.begin for m in steps]
    origin = min(times) if times else 0.0
    figure = Figure(figsize=(12, 1.2 + 0.7 * len(links)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()

    for lane, link in enumerate(links):
        y = len(links) - 1 - lane  # compute on top
        work = [(s.start - origin, s.end - s.start) for s in spans if s.link is link and s.kind is SpanKind.WORK]
        axes.broken_barh(work, (y - 0.35, 0.7), facecolors=_COLORS[link], alpha=0.75, linewidth=0)
        waits = [(s.start - origin, s.end - s.start) for s in spans
                 if s.kind is SpanKind.WAIT and (s.link is link or link is Link.COMPUTE)]
        height = 0.35 if link is Link.COMPUTE else 0.12
        axes.broken_barh(waits, (y - 0.35, height), facecolors=_WAIT_COLOR, linewidth=0)

    for mark in steps:
        for boundary in (mark.begin - origin, mark.end - origin):
            axes.axvline(boundary, color="0.3", linestyle="--", linewidth=0.8)
        axes.text(mark.begin - origin, len(links) - 0.45, f" step {mark.step}", fontsize=8, va="bottom")

    axes.set_yticks(range(len(links)), [_lane_label(link, summary["median"]) for link in reversed(links)], fontsize=8)
    axes.set_ylim(-0.6, len(links) - 0.1 + 0.3)
    axes.set_xlabel("seconds")
    axes.set_title(_title(summary))
    axes.plot([], [], color=_WAIT_COLOR, linewidth=6, label="waiting on a link (exposed)")
    axes.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True
