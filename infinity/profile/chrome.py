"""Chrome trace event JSON: open in https://ui.perfetto.dev or chrome://tracing.

One process per rank (pid = rank), one thread row per link lane (tid): a
"steps" row with one event per step, then "compute" (which also shows the
waits, category "wait", since compute is what blocks), then the other links
in `Link` order. Every span is a complete ("X") event, ts/dur in microseconds
on the `time.perf_counter()` clock (shared by the processes of one host, so
the traces of its ranks can be concatenated into one file).

Note (sub-lanes): the trace viewers need the events of one row to nest; a
link with concurrent requests has overlapping spans that do not, so such a
link gets extra rows ("nvme_read (2)", ...), filled greedily.
"""

from __future__ import annotations

from infinity.profile.records import Link, Span, SpanKind, StepMark

_US = 1e6


def pack_lanes(spans: list[Span]) -> list[list[Span]]:
    """Split spans into rows where any two spans are disjoint or nested."""
    rows: list[list[Span]] = []
    open_ends: list[list[float]] = []  # per row: the ends of the spans still open, innermost last
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        for row, ends in zip(rows, open_ends):
            while ends and ends[-1] <= span.start:
                ends.pop()
            if not ends or span.end <= ends[-1]:
                break
        else:
            rows.append([])
            open_ends.append([])
            row, ends = rows[-1], open_ends[-1]
        row.append(span)
        ends.append(span.end)
    return rows


def _event(span: Span, pid: int, tid: int) -> dict:
    duration = span.end - span.start
    args: dict = {"link": span.link.value}
    if span.num_bytes:
        args["bytes"] = span.num_bytes
        if duration > 0:
            args["GBps"] = round(span.num_bytes / duration / 1e9, 3)
    if span.unit is not None:
        args["unit"] = span.unit
    return {
        "name": span.name,
        "cat": span.kind.value,
        "ph": "X",
        "ts": round(span.start * _US, 3),
        "dur": round(duration * _US, 3),
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def _metadata(name: str, pid: int, tid: int, value) -> dict:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def chrome_trace(spans: list[Span], steps: list[StepMark], *, rank: int = 0) -> dict:
    """The trace as a JSON-ready dict ({"traceEvents": [...], ...})."""
    pid = rank
    events = [_metadata("process_name", pid, 0, f"rank {rank}"), _metadata("process_sort_index", pid, 0, rank)]
    tid = 0
    events += [_metadata("thread_name", pid, tid, "steps"), _metadata("thread_sort_index", pid, tid, tid)]
    for mark in steps:
        duration = mark.end - mark.begin
        events.append({
            "name": f"step {mark.step}", "cat": "step", "ph": "X", "ts": round(mark.begin * _US, 3),
            "dur": round(duration * _US, 3), "pid": pid, "tid": tid, "args": {"step": mark.step},
        })  # fmt: skip
    for link in Link:
        if link is Link.COMPUTE:  # compute's row holds every wait: it is compute that is blocked
            on_row = [s for s in spans if s.link is Link.COMPUTE or s.kind is SpanKind.WAIT]
        else:
            on_row = [s for s in spans if s.link is link and s.kind is SpanKind.WORK]
        for index, row in enumerate(pack_lanes(on_row)):
            tid += 1
            row_name = link.value if index == 0 else f"{link.value} ({index + 1})"
            events += [_metadata("thread_name", pid, tid, row_name), _metadata("thread_sort_index", pid, tid, tid)]
            events += [_event(span, pid, tid) for span in row]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"rank": rank, "clock": "time.perf_counter", "unit": "us"},
    }
