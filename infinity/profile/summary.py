"""The overlap summary: what each step spent, per link, from the spans.

The contract (every time in seconds, every byte count in bytes, GB = 1e9 B):

- Steps: each completed `step_begin(i)` .. `step_end(i)` pair is one window;
  `step_s` = end - begin. When no step was marked but spans exist, the whole
  recording (first span start .. last span end) is one window with `step: None`.
- Clipping: every span is clipped to the window. A span crossing a boundary
  counts only its inside part, and its bytes in proportion to that part
  (a zero-length span counts whole in the window holding its start).
- `compute_s`: length of the union of the COMPUTE spans.
- `exposed_s`: length of the union of all WAIT spans (compute blocked on any link).
- `overlap_efficiency` = compute_s / step_s (None for a zero-length step).
- `on_demand_fetches`: the unshards in the window that no prefetch had issued
  (spans named `ON_DEMAND ...`, Note [backward prefetch] in prefetch.py).
- Per link other than COMPUTE, under `links[link.value]`:
  - `bytes`: sum of the spans' `num_bytes` (rounded to an integer after clipping);
  - `busy_s`: length of the union of the link's WORK spans: concurrent
    requests overlapping in time count once, not summed;
  - `GBps` = bytes / busy_s / 1e9 (0.0 with no bytes; None when bytes moved
    in zero busy time);
  - `peak_GBps`: the measured peak given to the profiler, or None;
  - `fraction_of_peak` = GBps / peak_GBps, or None without both;
  - `exposed_s`: length of the union of the WAIT spans on that link.
  Reported links: those with any span or wait in the recording, plus those
  with a peak; the same set in every step, in `Link` order.
- `median`: the same fields, each the median over steps of that field
  (None values left out; None when no step has one); None with no steps.
"""

from __future__ import annotations

import statistics
from typing import Iterable

from infinity.profile.records import ON_DEMAND, Link, Span, SpanKind, StepMark

GB = 1e9


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same points; empty ones dropped."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    return sum(end - start for start, end in merge_intervals(intervals))


def _clipped(spans: Iterable[Span], begin: float, end: float) -> list[tuple[float, float]]:
    """The parts of the spans inside [begin, end]."""
    return [(max(s.start, begin), min(s.end, end)) for s in spans if s.start < end and s.end > begin]


def _bytes_inside(span: Span, begin: float, end: float) -> float:
    """The share of the span's bytes that falls inside [begin, end)."""
    if span.num_bytes == 0:
        return 0.0
    duration = span.end - span.start
    if duration <= 0:
        return float(span.num_bytes) if begin <= span.start < end else 0.0
    inside = min(span.end, end) - max(span.start, begin)
    return span.num_bytes * inside / duration if inside > 0 else 0.0


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _link_summary(work: list[Span], waits: list[Span], begin: float, end: float, peak: float | None) -> dict:
    num_bytes = round(sum(_bytes_inside(s, begin, end) for s in work))
    busy_s = union_length(_clipped(work, begin, end))
    GBps = 0.0 if num_bytes == 0 else _ratio(num_bytes / GB, busy_s)
    return {
        "bytes": num_bytes,
        "busy_s": busy_s,
        "GBps": GBps,
        "peak_GBps": peak,
        "fraction_of_peak": _ratio(GBps, peak) if GBps is not None and peak else None,
        "exposed_s": union_length(_clipped(waits, begin, end)),
    }


def summarize_window(spans: list[Span], step: int | None, begin: float, end: float, links: list[Link],
                     peaks_GBps: dict[Link, float]) -> dict:
    """The summary of one step window (see the module docstring)."""
    work = [s for s in spans if s.kind is SpanKind.WORK]
    waits = [s for s in spans if s.kind is SpanKind.WAIT]
    step_s = end - begin
    compute_s = union_length(_clipped((s for s in work if s.link is Link.COMPUTE), begin, end))
    return {
        "step": step,
        "step_s": step_s,
        "compute_s": compute_s,
        "exposed_s": union_length(_clipped(waits, begin, end)),
        "overlap_efficiency": _ratio(compute_s, step_s),
        "on_demand_fetches": sum(1 for s in spans if s.name.startswith(ON_DEMAND) and begin <= s.start <= end),
        "links": {
            link.value: _link_summary(
                [s for s in work if s.link is link], [s for s in waits if s.link is link], begin, end,
                peaks_GBps.get(link)
            )
            for link in links
        },
    }


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _median_of_steps(steps: list[dict]) -> dict | None:
    if not steps:
        return None
    scalar_fields = ("step_s", "compute_s", "exposed_s", "overlap_efficiency", "on_demand_fetches")
    median = {field: _median([s[field] for s in steps]) for field in scalar_fields}
    median["links"] = {
        name: {field: _median([s["links"][name][field] for s in steps]) for field in fields}
        for name, fields in steps[0]["links"].items()
    }
    return median


def summarize(spans: list[Span], steps: list[StepMark], peaks_GBps: dict[Link, float] | None = None, *,
              rank: int = 0) -> dict:
    """{"rank", "num_steps", "steps": [per-step summary], "median": {...}}."""
    peaks_GBps = peaks_GBps or {}
    seen = {s.link for s in spans} | set(peaks_GBps)
    links = [link for link in Link if link in seen and link is not Link.COMPUTE]
    windows = [(m.step, m.begin, m.end) for m in steps]
    if not windows and spans:
        windows = [(None, min(s.start for s in spans), max(s.end for s in spans))]
    per_step = [summarize_window(spans, step, begin, end, links, peaks_GBps) for step, begin, end in windows]
    return {"rank": rank, "num_steps": len(per_step), "steps": per_step, "median": _median_of_steps(per_step)}


# ---- the printed table ------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_summary(summary: dict, last: int | None = None) -> str:
    """A human-readable table: one row per step (the `last` ones only, when given), then one row per link
    (medians)."""
    median = summary.get("median")
    if median is None:
        return f"profile rank {summary.get('rank', 0)}: no steps, no spans"
    lines = [
        f"profile rank {summary['rank']}: {summary['num_steps']} step(s), median step {_ms(median['step_s'])} ms, "
        f"compute {_ms(median['compute_s'])} ms, exposed {_ms(median['exposed_s'])} ms, "
        f"overlap efficiency {_percent(median['overlap_efficiency'])}, "
        f"on-demand fetches {max(s['on_demand_fetches'] for s in summary['steps'])} (most in a step)",
        f"{'step':>6} {'step_ms':>10} {'compute_ms':>11} {'exposed_ms':>11} {'overlap':>8}",
    ]
    steps = summary["steps"]
    if last is not None and len(steps) > last:
        lines.append(f"{'...':>6} ({len(steps) - last} earlier step(s) not shown; the median is over all of them)")
        steps = steps[-last:]
    for s in steps:
        step = "all" if s["step"] is None else str(s["step"])
        lines.append(f"{step:>6} {_ms(s['step_s']):>10} {_ms(s['compute_s']):>11} {_ms(s['exposed_s']):>11} "
                     f"{_percent(s['overlap_efficiency']):>8}")
    if median["links"]:
        lines.append("per link, median over steps:")
        lines.append(f"{'link':<15} {'MB/step':>10} {'busy_ms':>9} {'GB/s':>7} {'peak':>7} {'of peak':>8} "
                     f"{'exposed_ms':>11}")
        for name, link in median["links"].items():
            megabytes = None if link["bytes"] is None else link["bytes"] / 1e6
            lines.append(
                f"{name:<15} {_number(megabytes, '.1f'):>10} {_ms(link['busy_s']):>9} "
                f"{_number(link['GBps'], '.2f'):>7} {_number(link['peak_GBps'], '.2f'):>7} "
                f"{_percent(link['fraction_of_peak']):>8} {_ms(link['exposed_s']):>11}"
            )
    return "\n".join(lines)
