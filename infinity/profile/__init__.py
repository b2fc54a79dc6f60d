"""Span profiler: every fetch, copy, collective, optimizer sub-step and unit
compute of a training step becomes a span on one *link*; the spans become a
Chrome trace, an overlap summary and a timeline chart.

    prof = Profiler(rank=0, peaks_GBps={Link.NVME_READ: 6.5})   # or NullProfiler()
    prof.step_begin(step)
    with prof.span("unit blocks.3 forward", Link.COMPUTE, unit="blocks.3"): ...
    with prof.wait(Link.NVME_READ, "wait params blocks.4"): ...  # exposed time
    prof.record("write master c0", Link.NVME_WRITE, start=t0, end=t1, num_bytes=n)
    prof.step_end(step)
    prof.write("profile/rank0")   # trace.json, summary.json, timeline.png

Layout:
    records.py  Link, SpanKind, Span, StepMark: what is recorded (the writers read only these)
    spans.py    Profiler (recording, thread-safe), NullProfiler
    device.py   CUDA-event spans mapped onto the host clock
    summary.py  interval unions per step and link: the summary contract
    chrome.py   Chrome trace event JSON (Perfetto, chrome://tracing)
    chart.py    timeline PNG (needs matplotlib; skipped without it)
"""

from infinity.profile.records import Link, Span, SpanKind, StepMark
from infinity.profile.spans import NullProfiler, Profiler
from infinity.profile.summary import format_summary, summarize, union_length

__all__ = [
    "Link",
    "NullProfiler",
    "Profiler",
    "Span",
    "SpanKind",
    "StepMark",
    "format_summary",
    "summarize",
    "union_length",
]
