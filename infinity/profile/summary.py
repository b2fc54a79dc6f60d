"""The overlap summary: what each step spent, per link, from the spans.

The contract (every time in seconds, every byte count in bytes, GB = 1e9 B):

- Steps: each completed `step_begin(i)` .. `step_end(i)` pair is one window;
  `step_s` = end - begin. When no step was marked but spans exist, the whole
  recording (first span start .. last span end) is one window with `step: None`.
- Clipping: every span's time is clipped to the window: a span crossing a boundary counts only its inside
  part. Its bytes count whole in the window holding its start (the step that issued the transfer), so a
  step's bytes are whole transfers, comparable with the byte model's per step (`traffic.bytes_per_step`).
- `parts` (Note [step attribution]): every instant of the step belongs to one part, the first in this
  order whose spans cover it: `compute` (the COMPUTE spans: the training thread's compute on the CPU, the
  compute stream's device time on a GPU), `exposed.<link>` (the training thread waited on that link, in
  `Link` order, and nothing computed), `host.<part>` (HOST spans: the training thread ran host code, in
  `HOST_PARTS` order), and `unattributed` (no span covers it). So the parts add up to `step_s` exactly, and
  `unattributed` is what no span accounts for (shown, never folded into another part).
- `compute_s`, `exposed_s`, `host_s`, `unattributed_s`: the parts' totals; step_s is their sum.
- `overlap_efficiency` = compute_s / step_s = 1 - (exposed_s + host_s + unattributed_s) / step_s (None for
  a zero-length step): the share of the step the compute was busy; what it lost is in the other parts.
- `attributed` = 1 - unattributed_s / step_s: the share of the step named by a part.
- `host_syncs`: the host synchronizations in the window, on every thread (SYNC marks: Note [host syncs] in
  device/streams.py), `host_syncs_training` those of the training thread alone (None when it is not known),
  and `host_syncs_by_reason` per reason (the thread in parentheses).
- `on_demand_fetches`: the unshards in the window that no prefetch had issued
  (spans named `ON_DEMAND ...`, Note [backward prefetch] in prefetch.py).
- Per link other than COMPUTE, under `links[link.value]`:
  - `bytes`: sum of the `num_bytes` of the spans that start in the window;
  - `busy_s`: length of the union of the link's WORK spans: concurrent
    requests overlapping in time count once, not summed;
  - `GBps` = bytes / busy_s / 1e9 (0.0 with no bytes; None when bytes moved
    in zero busy time);
  - `peak_GBps`: the measured peak given to the profiler, or None;
  - `fraction_of_peak` = GBps / peak_GBps, or None without both;
  - `exposed_s`: the link's part of the step (`parts["exposed"]`).
  Reported links: those with any span or wait in the recording, plus those
  with a peak or a predicted byte count; the same set in every step, in `Link` order.
  With `predicted_bytes` (the byte model's bytes per steady step, `traffic.bytes_per_step`, given by the
  engine), the median's links carry `predicted_bytes` beside `bytes`.
- `median`: the parts and their totals (`step`, `step_s`, `compute_s`, `exposed_s`, `host_s`,
  `unattributed_s`, `attributed`, `overlap_efficiency`, `parts`) are those of the median step (the step
  whose step_s is the median; the lower middle one of an even count), so they add up; the other fields
  (`on_demand_fetches`, `host_syncs`, each link's) are each the median over steps of that field (None
  values left out; None when no step has one). None with no steps.
"""

from __future__ import annotations

import bisect
import statistics
from typing import Iterable

from infinity.profile.records import HOST_PARTS, ON_DEMAND, Link, Span, SpanKind, StepMark

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


def _bytes_inside(span: Span, begin: float, end: float) -> int:
    """The span's bytes when it starts in [begin, end) (a transfer counts whole in the step that issued it)."""
    return span.num_bytes if begin <= span.start < end else 0


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _link_summary(work: list[Span], begin: float, end: float, peak: float | None, exposed_s: float) -> dict:
    num_bytes = sum(_bytes_inside(s, begin, end) for s in work)
    busy_s = union_length(_clipped(work, begin, end))
    GBps = 0.0 if num_bytes == 0 else _ratio(num_bytes / GB, busy_s)
    return {
        "bytes": num_bytes,
        "busy_s": busy_s,
        "GBps": GBps,
        "peak_GBps": peak,
        "fraction_of_peak": _ratio(GBps, peak) if GBps is not None and peak else None,
        "exposed_s": exposed_s,
    }


def _part_of(span: Span) -> tuple | None:
    """The part a span of the training thread claims (Note [step attribution]), or None."""
    if span.kind is SpanKind.WORK:
        return ("compute",) if span.link is Link.COMPUTE else None
    if span.kind is SpanKind.WAIT:
        return ("exposed", span.link.value)
    if span.kind is SpanKind.HOST:
        return ("host", span.name)
    return None


def attribute(spans: list[Span], begin: float, end: float) -> dict:
    """Note [step attribution]: the step [begin, end] split into parts, each instant to the first part in order
    of precedence (compute, the waits in `Link` order, the host parts in `HOST_PARTS` order, names it does not
    know before `caller`) whose spans cover it; what no span covers is `unattributed`. The parts add up to
    end - begin."""
    waits = [("exposed", link.value) for link in Link]
    known = [("host", name) for name in HOST_PARTS if name != "caller"]
    claims = [(part, s) for s in spans if (part := _part_of(s)) is not None and s.start < end and s.end > begin]
    others = sorted({p for p, _ in claims if p[0] == "host" and p[1] not in HOST_PARTS})
    order = [("compute",)] + waits + known + others + [("host", "caller")]
    rank = {part: i for i, part in enumerate(order)}
    events = []
    for part, s in claims:
        events += [(max(s.start, begin), 1, rank[part]), (min(s.end, end), -1, rank[part])]
    events.sort()
    active = [0] * len(order)
    length = [0.0] * len(order)
    last = begin
    for time, delta, i in events:
        top = next((j for j, n in enumerate(active) if n), None)
        if top is not None:
            length[top] += time - last
        last = time
        active[i] += delta
    parts = {"compute": length[0], "exposed": {}, "host": {}}
    for part, i in rank.items():
        if part[0] != "compute" and (length[i] > 0 or part[0] == "host" and part[1] in HOST_PARTS):
            parts[part[0]][part[1]] = length[i]
    parts["unattributed"] = max(0.0, (end - begin) - sum(length))
    return parts


def summarize_window(spans: list[Span], step: int | None, begin: float, end: float, links: list[Link],
                     peaks_GBps: dict[Link, float], training_thread: str | None = None) -> dict:
    """The summary of one step window (see the module docstring)."""
    work = [s for s in spans if s.kind is SpanKind.WORK]
    step_s = end - begin
    parts = attribute(spans, begin, end)
    exposed_s, host_s = sum(parts["exposed"].values()), sum(parts["host"].values())
    syncs: dict[str, int] = {}
    for s in spans:
        if s.kind is SpanKind.SYNC and begin <= s.start < end:
            syncs[s.name] = syncs.get(s.name, 0) + 1
    return {
        "step": step,
        "step_s": step_s,
        "compute_s": parts["compute"],
        "exposed_s": exposed_s,
        "host_s": host_s,
        "unattributed_s": parts["unattributed"],
        "attributed": _ratio(step_s - parts["unattributed"], step_s),
        "overlap_efficiency": overlap_efficiency(parts, step_s),
        "parts": parts,
        "on_demand_fetches": sum(1 for s in spans if s.name.startswith(ON_DEMAND) and begin <= s.start <= end),
        "host_syncs": sum(syncs.values()),
        "host_syncs_training": None if training_thread is None else sum(
            n for why, n in syncs.items() if why.endswith(f"({training_thread})")),
        "host_syncs_by_reason": syncs,
        "links": {
            link.value: _link_summary([s for s in work if s.link is link], begin, end, peaks_GBps.get(link),
                                      parts["exposed"].get(link.value, 0.0))
            for link in links
        },
    }


def overlap_efficiency(parts: dict, step_s: float) -> float | None:
    """The one formula (Note [step attribution]): the share of the step the compute was busy, compute_s /
    step_s = 1 - (exposed_s + host_s + unattributed_s) / step_s; None for a zero-length step."""
    return _ratio(parts["compute"], step_s)


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


MEDIAN_STEP_FIELDS = ("step", "step_s", "compute_s", "exposed_s", "host_s", "unattributed_s", "attributed",
                      "overlap_efficiency", "parts")


def _median_of_steps(steps: list[dict], predicted_bytes: dict[str, int] | None) -> dict | None:
    if not steps:
        return None
    middle = sorted(steps, key=lambda s: s["step_s"])[(len(steps) - 1) // 2]  # the median step (lower middle)
    median = {field: middle[field] for field in MEDIAN_STEP_FIELDS}
    median["on_demand_fetches"] = _median([s["on_demand_fetches"] for s in steps])
    median["host_syncs"] = _median([s["host_syncs"] for s in steps])
    median["host_syncs_training"] = _median([s["host_syncs_training"] for s in steps])
    reasons = sorted({r for s in steps for r in s["host_syncs_by_reason"]})
    median["host_syncs_by_reason"] = {r: _median([s["host_syncs_by_reason"].get(r, 0) for s in steps])
                                      for r in reasons}
    median["links"] = {
        name: {field: _median([s["links"][name][field] for s in steps]) for field in fields}
        for name, fields in steps[0]["links"].items()
    }
    for name, link in median["links"].items():
        if predicted_bytes is not None and name in predicted_bytes:
            link["predicted_bytes"] = predicted_bytes[name]
    return median


def _spans_by_window(spans: list[Span], windows: list[tuple[float, float]]) -> list[list[Span]]:
    """The spans touching each window [begin, end] (edges included: all `summarize_window` reads of a window),
    each span found by bisection over the windows' begins and ends, not by a scan of every span per window
    (which made a long run's summary quadratic). Windows in order (each ends before the next ends): a step's."""
    begins, ends = [b for b, _ in windows], [e for _, e in windows]
    if any(b1 < b0 or e1 < e0 for b0, b1, e0, e1 in zip(begins, begins[1:], ends, ends[1:])):
        return [[s for s in spans if s.start <= e and s.end >= b] for b, e in windows]  # (out of order: scan)
    touching: list[list[Span]] = [[] for _ in windows]
    for span in spans:
        for i in range(bisect.bisect_left(ends, span.start), bisect.bisect_right(begins, span.end)):
            touching[i].append(span)
    return touching


def summarize(spans: list[Span], steps: list[StepMark], peaks_GBps: dict[Link, float] | None = None, *,
              rank: int = 0, predicted_bytes: dict[str, int] | None = None, training_thread: str | None = None,
              forgotten_steps: int = 0) -> dict:
    """{"rank", "num_steps", "steps": [per-step summary], "median": {...}, "forgotten_steps"}; `training_thread`:
    the name of the thread that trains (its host syncs are counted apart: `host_syncs_training`);
    `forgotten_steps`: the steps profiled before these, whose spans were not kept (Note [profile window])."""
    peaks_GBps = peaks_GBps or {}
    seen = {s.link for s in spans if s.kind in (SpanKind.WORK, SpanKind.WAIT)} | set(peaks_GBps)
    seen |= {Link(name) for name in predicted_bytes or {}}
    links = [link for link in Link if link in seen and link is not Link.COMPUTE]
    windows = [(m.step, m.begin, m.end) for m in steps]
    if not windows and spans:
        windows = [(None, min(s.start for s in spans), max(s.end for s in spans))]
    touching = _spans_by_window(spans, [(begin, end) for _, begin, end in windows])
    per_step = [summarize_window(near, step, begin, end, links, peaks_GBps, training_thread)
                for near, (step, begin, end) in zip(touching, windows)]
    return {"rank": rank, "num_steps": len(per_step), "steps": per_step,
            "median": _median_of_steps(per_step, predicted_bytes), "forgotten_steps": forgotten_steps}


# ---- the printed table ------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def parts_text(row: dict) -> str:
    """The step's split in one line: `step = compute + exposed (by link) + host (by part) + unattributed`."""
    parts = row["parts"]
    exposed = ", ".join(f"{k} {_ms(v)}" for k, v in parts["exposed"].items() if v > 0)
    host = ", ".join(f"{k} {_ms(v)}" for k, v in parts["host"].items() if v > 0)
    return (f"step {_ms(row['step_s'])} ms = compute {_ms(row['compute_s'])} + exposed {_ms(row['exposed_s'])}"
            f"{f' ({exposed})' if exposed else ''} + host {_ms(row['host_s'])}{f' ({host})' if host else ''}"
            f" + unattributed {_ms(row['unattributed_s'])} ({_percent(_ratio(row['unattributed_s'], row['step_s']))})")


def _covered(summary: dict) -> str:
    """Which steps of the run the profile holds, numbered as metrics.jsonl numbers them (from 1): the latest
    ones when earlier steps' spans were not kept (Note [profile window]), and a profile whose first recorded
    step is later than 1 is the segment since a resume (the earlier steps are not in it)."""
    numbers = [s["step"] for s in summary["steps"] if s.get("step") is not None]
    if not numbers:
        return ""
    first, last = min(numbers), max(numbers)
    forgotten = summary.get("forgotten_steps") or 0
    began = first - forgotten  # (the first step this profile recorded)
    return (f" (steps {first}-{last} of the run"
            + (f", the latest {len(numbers)} kept ([profile] keep_steps)" if forgotten else "")
            + (f"{'; the segment' if forgotten else ': the segment'} since the resume at step {began - 1}"
               if began > 1 else "") + ")")


def format_summary(summary: dict, last: int | None = None) -> str:
    """A human-readable table: which steps it covers, the median step's split, one row per step (the `last`
    ones only, when given; 0: none), then one row per link (medians)."""
    median = summary.get("median")
    if median is None:
        return f"profile rank {summary.get('rank', 0)}: no steps, no spans"
    if "parts" not in median:  # written before Note [step attribution]
        return (f"profile rank {summary['rank']}: {summary['num_steps']} step(s), median step "
                f"{_ms(median['step_s'])} ms, compute {_ms(median['compute_s'])} ms, exposed "
                f"{_ms(median['exposed_s'])} ms; this summary predates the step's split into parts: profile the "
                f"run again to see where each millisecond goes")
    lines = [
        f"profile rank {summary['rank']}: {summary['num_steps']} step(s){_covered(summary)}, median step "
        f"{_ms(median['step_s'])} ms, "
        f"compute {_ms(median['compute_s'])} ms, exposed {_ms(median['exposed_s'])} ms, "
        f"host {_ms(median['host_s'])} ms, unattributed {_ms(median['unattributed_s'])} ms, "
        f"overlap efficiency {_percent(median['overlap_efficiency'])} (compute / step), "
        f"on-demand fetches {max(s['on_demand_fetches'] for s in summary['steps'])} (most in a step), "
        f"host syncs {_number(median['host_syncs'], '.0f')} per step"
        + ("" if median.get("host_syncs_training") is None else
           f" ({_number(median['host_syncs_training'], 'g')} on the training thread)"),
        f"median step ({median['step']}): {parts_text(median)}",
    ]
    if median["host_syncs_by_reason"]:
        lines.append("host syncs per step (median): " + ", ".join(
            f"{why} {_number(n, 'g')}" for why, n in median["host_syncs_by_reason"].items()))
    lines.append(f"{'step':>6} {'step_ms':>10} {'compute_ms':>11} {'exposed_ms':>11} {'host_ms':>9} "
                 f"{'unattr_ms':>10} {'overlap':>8} {'syncs':>6}")
    steps = summary["steps"]
    if last is not None and len(steps) > last:
        lines.append(f"{'...':>6} ({len(steps) - last} earlier step(s) not shown; the median is over all of them)")
        steps = steps[len(steps) - last:]  # (not steps[-last:]: last = 0 shows none)
    for s in steps:
        step = "all" if s["step"] is None else str(s["step"])
        lines.append(f"{step:>6} {_ms(s['step_s']):>10} {_ms(s['compute_s']):>11} {_ms(s['exposed_s']):>11} "
                     f"{_ms(s['host_s']):>9} {_ms(s['unattributed_s']):>10} {_percent(s['overlap_efficiency']):>8} "
                     f"{s['host_syncs']:>6}")
    if median["links"]:
        lines.append("per link, median over steps:")
        lines.append(f"{'link':<15} {'MB/step':>10} {'predicted':>10} {'busy_ms':>9} {'GB/s':>7} {'peak':>7} "
                     f"{'of peak':>8} {'exposed_ms':>11}")
        for name, link in median["links"].items():
            megabytes = None if link["bytes"] is None else link["bytes"] / 1e6
            predicted = link.get("predicted_bytes")
            lines.append(
                f"{name:<15} {_number(megabytes, '.1f'):>10} "
                f"{_number(None if predicted is None else predicted / 1e6, '.1f'):>10} {_ms(link['busy_s']):>9} "
                f"{_number(link['GBps'], '.2f'):>7} {_number(link['peak_GBps'], '.2f'):>7} "
                f"{_percent(link['fraction_of_peak']):>8} {_ms(link['exposed_s']):>11}"
            )
    return "\n".join(lines)
