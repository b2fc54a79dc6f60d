"""The span profiler against its formulas, on synthetic spans with explicit times."""

import json
import threading
import tracemalloc

import pytest
import torch

from infinity.profile import Link, NullProfiler, Profiler, format_summary, union_length
from infinity.profile.chrome import pack_lanes

GB = 1e9


def profiler_with_step(begin=10.0, end=11.0, step=0, **kwargs) -> Profiler:
    """A profiler with one step at fixed host times."""
    prof = Profiler(**kwargs)
    prof.record_step(step, begin, end)
    return prof


def test_union_of_overlapping_intervals():
    assert union_length([]) == 0.0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(2 + 1)
    assert union_length([(0, 4), (1, 2), (2, 3)]) == pytest.approx(4)  # nested
    assert union_length([(0, 1), (1, 2)]) == pytest.approx(2)  # touching
    assert union_length([(1, 1), (2, 1.5)]) == 0.0  # empty and inverted


def test_link_bytes_busy_GBps_and_fraction_of_peak():
    prof = profiler_with_step(peaks_GBps={Link.NVME_READ: 4.0})
    # two concurrent reads overlapping by 0.1 s, then one alone
    prof.record("read a", Link.NVME_READ, 10.0, 10.2, num_bytes=300_000_000)
    prof.record("read b", Link.NVME_READ, 10.1, 10.3, num_bytes=300_000_000)
    prof.record("read c", Link.NVME_READ, 10.5, 10.6, num_bytes=200_000_000)
    link = prof.summary()["steps"][0]["links"]["nvme_read"]
    busy_s = (10.3 - 10.0) + (10.6 - 10.5)  # the union, not the sum 0.5 s
    total_bytes = 300_000_000 * 2 + 200_000_000
    assert link["bytes"] == total_bytes
    assert link["busy_s"] == pytest.approx(busy_s)
    assert link["GBps"] == pytest.approx(total_bytes / busy_s / GB)
    assert link["peak_GBps"] == 4.0
    assert link["fraction_of_peak"] == pytest.approx(total_bytes / busy_s / GB / 4.0)
    assert link["exposed_s"] == 0.0


def test_exposed_time_is_the_union_of_waits_per_link():
    prof = profiler_with_step()
    prof.record_wait(Link.NVME_READ, "wait params blocks.1", 10.1, 10.2)
    prof.record_wait(Link.NVME_READ, "wait params blocks.2", 10.15, 10.25)
    prof.record_wait(Link.ALL_GATHER, "wait gather blocks.2", 10.4, 10.5)
    step = prof.summary()["steps"][0]
    assert step["links"]["nvme_read"]["exposed_s"] == pytest.approx(0.15)
    assert step["links"]["all_gather"]["exposed_s"] == pytest.approx(0.1)
    assert step["links"]["all_gather"]["bytes"] == 0
    assert step["links"]["all_gather"]["GBps"] == 0.0  # a link with zero bytes
    assert step["links"]["all_gather"]["fraction_of_peak"] is None
    assert step["exposed_s"] == pytest.approx(0.15 + 0.1)


def test_wait_context_manager_records_a_wait():
    prof = Profiler()
    with prof.wait(Link.H2D, "wait h2d"):
        pass
    (span,) = prof.spans()
    assert span.kind.value == "wait" and span.link is Link.H2D and span.end >= span.start


def test_compute_time_and_overlap_efficiency():
    prof = profiler_with_step(begin=0.0, end=2.0)
    prof.record("unit blocks.0 forward", Link.COMPUTE, 0.0, 0.6, unit="blocks.0")
    prof.record("unit blocks.1 forward", Link.COMPUTE, 0.5, 1.0, unit="blocks.1")  # overlaps the first
    prof.record("read", Link.NVME_READ, 0.0, 2.0, num_bytes=1)
    step = prof.summary()["steps"][0]
    compute_s = 1.0  # union [0, 1.0]
    assert step["step_s"] == pytest.approx(2.0)
    assert step["compute_s"] == pytest.approx(compute_s)
    assert step["overlap_efficiency"] == pytest.approx(compute_s / 2.0)
    assert "compute" not in step["links"]


def test_spans_crossing_step_boundaries_are_clipped():
    prof = Profiler()
    prof.record_step(0, 0.0, 1.0)
    prof.record_step(1, 1.0, 2.0)
    # 1 s read crossing the boundary: 0.25 s in step 0, 0.75 s in step 1; its bytes in step 0, which issued it
    prof.record("read", Link.NVME_READ, 0.75, 1.75, num_bytes=400)
    prof.record("unit", Link.COMPUTE, -0.5, 0.5)  # starts before any step
    prof.record("instant", Link.NVME_WRITE, 1.0, 1.0, num_bytes=7)  # zero length: the step holding its start
    step0, step1 = prof.summary()["steps"]
    assert step0["links"]["nvme_read"]["busy_s"] == pytest.approx(0.25)
    assert step0["links"]["nvme_read"]["bytes"] == 400
    assert step1["links"]["nvme_read"]["busy_s"] == pytest.approx(0.75)
    assert step1["links"]["nvme_read"]["bytes"] == 0
    assert step0["compute_s"] == pytest.approx(0.5)
    assert step1["compute_s"] == 0.0
    assert step0["links"]["nvme_write"]["bytes"] == 0 and step1["links"]["nvme_write"]["bytes"] == 7
    assert step1["links"]["nvme_write"]["GBps"] is None  # bytes in zero busy time: undefined


def test_median_over_steps():
    prof = Profiler()
    for i, length in enumerate([1.0, 3.0, 2.0]):
        prof.record_step(i, 10.0 * i, 10.0 * i + length)
    for i in range(3):
        prof.record("unit", Link.COMPUTE, 10.0 * i, 10.0 * i + 0.5)
    summary = prof.summary()
    assert summary["num_steps"] == 3
    assert summary["median"]["step_s"] == pytest.approx(2.0)
    assert summary["median"]["compute_s"] == pytest.approx(0.5)
    assert summary["median"]["overlap_efficiency"] == pytest.approx(0.5 / 2.0)


def test_no_spans_and_no_steps():
    prof = Profiler()
    assert prof.summary() == {"rank": 0, "num_steps": 0, "steps": [], "median": None, "forgotten_steps": 0}
    assert "no steps" in format_summary(prof.summary())
    prof.step_begin(0)
    prof.step_end(0)
    step = prof.summary()["steps"][0]
    assert step["compute_s"] == 0.0 and step["links"] == {}
    format_summary(prof.summary())


def test_without_step_marks_the_recording_is_one_step():
    prof = Profiler()
    prof.record("unit", Link.COMPUTE, 1.0, 2.0)
    prof.record("read", Link.NVME_READ, 1.5, 3.0, num_bytes=10)
    (step,) = prof.summary()["steps"]
    assert step["step"] is None and step["step_s"] == pytest.approx(2.0)


def test_step_marks_must_pair():
    prof = Profiler()
    with pytest.raises(ValueError, match="without step_begin"):
        prof.step_end(3)
    prof.step_begin(3)
    with pytest.raises(ValueError, match="twice"):
        prof.step_begin(3)
    with pytest.raises(ValueError, match="ends before"):
        prof.record("bad", Link.H2D, 2.0, 1.0)


def test_record_from_8_threads():
    prof = Profiler()
    per_thread = 2000
    barrier = threading.Barrier(8)

    def completions(worker: int):
        barrier.wait()
        for i in range(per_thread):
            prof.record(f"write {worker}.{i}", Link.NVME_WRITE, 1.0, 2.0, num_bytes=1)
            with prof.span("span", Link.CPU_OPTIMIZER):
                pass

    threads = [threading.Thread(target=completions, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = prof.spans()
    assert len(spans) == 8 * per_thread * 2
    assert sum(s.num_bytes for s in spans) == 8 * per_thread


def test_span_records_host_time_and_bytes_set_inside():
    prof = Profiler()
    with prof.span("read blocks.3 params", Link.NVME_READ, unit="blocks.3") as span:
        span.num_bytes = 4096
    (recorded,) = prof.spans()
    assert recorded.num_bytes == 4096 and recorded.unit == "blocks.3" and recorded.end >= recorded.start


def test_null_profiler_records_nothing_and_allocates_nothing():
    prof = NullProfiler()
    assert not prof.enabled
    first = prof.span("a", Link.COMPUTE)
    assert prof.span("b", Link.NVME_READ, num_bytes=5) is first
    assert prof.wait(Link.H2D, "c") is first
    assert prof.device_span("d", Link.H2D) is first

    def calls():
        for _ in range(10_000):
            with prof.span("unit", Link.COMPUTE, unit="blocks.0"):
                pass
            with prof.wait(Link.NVME_READ, "wait"):
                pass
            prof.record("write", Link.NVME_WRITE, 0.0, 1.0, num_bytes=3)

    calls()  # warm up
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        calls()
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before < 4096, f"NullProfiler allocated {peak - before} bytes over 30000 calls"
    prof.step_begin(0)
    prof.step_end(0)
    assert prof.spans() == [] and prof.summary()["steps"] == []


def test_null_profiler_has_the_profiler_interface():
    def public(cls):
        return {name for name in dir(cls) if not name.startswith("_")}

    assert public(Profiler) == public(NullProfiler)


def test_peaks_by_name_and_validation():
    assert Profiler(peaks_GBps={"nvme_read": 2}).peaks_GBps == {Link.NVME_READ: 2.0}
    with pytest.raises(ValueError, match="positive"):
        Profiler(peaks_GBps={Link.H2D: 0})


def make_two_steps() -> Profiler:
    prof = Profiler(rank=3, peaks_GBps={Link.NVME_READ: 2.0})
    prof.record_step(0, 0.0, 1.0)
    prof.record_step(1, 1.0, 2.0)
    for step in range(2):
        t = float(step)
        prof.record("unit blocks.0 forward", Link.COMPUTE, t + 0.1, t + 0.5, unit="blocks.0")
        prof.record("unit blocks.0 inner", Link.COMPUTE, t + 0.2, t + 0.3, unit="blocks.0")  # nested
        prof.record("read a", Link.NVME_READ, t + 0.0, t + 0.4, num_bytes=500_000_000, unit="blocks.1")
        prof.record("read b", Link.NVME_READ, t + 0.2, t + 0.6, num_bytes=500_000_000, unit="blocks.2")  # concurrent
        prof.record_wait(Link.NVME_READ, "wait params blocks.2", t + 0.5, t + 0.6)
        prof.record("h2d", Link.H2D, t + 0.6, t + 0.65, num_bytes=500_000_000)
    return prof


def test_chrome_trace_is_valid(tmp_path):
    paths = make_two_steps().write(str(tmp_path), print_table=False)
    with open(paths["trace"]) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    for event in events:
        assert {"ph", "pid", "tid", "name"} <= event.keys()
    complete = [e for e in events if e["ph"] == "X"]
    for event in complete:
        assert {"ts", "dur"} <= event.keys() and event["dur"] >= 0 and event["pid"] == 3
    names = {e["name"] for e in complete}
    assert {"step 0", "step 1", "read a", "wait params blocks.2", "h2d"} <= names
    read = next(e for e in complete if e["name"] == "read a")
    assert read["args"]["bytes"] == 500_000_000 and read["args"]["unit"] == "blocks.1"
    assert read["dur"] == pytest.approx(0.4e6)
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"steps", "compute", "nvme_read", "nvme_read (2)", "h2d"} <= lanes  # concurrent reads: two rows
    with open(paths["summary"]) as f:
        assert json.load(f)["steps"][0]["links"]["nvme_read"]["busy_s"] == pytest.approx(0.6)


def test_lanes_hold_only_disjoint_or_nested_spans():
    prof = make_two_steps()
    for row in pack_lanes(prof.spans()):
        for a in row:
            for b in row:
                disjoint = a.end <= b.start or b.end <= a.start
                nested = (a.start <= b.start and b.end <= a.end) or (b.start <= a.start and a.end <= b.end)
                assert disjoint or nested, (a, b)


def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    paths = make_two_steps().write(str(tmp_path), print_table=False)
    with open(paths["timeline"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_write_prints_the_table(tmp_path, capsys):
    make_two_steps().write(str(tmp_path))
    printed = capsys.readouterr().out
    assert "overlap efficiency" in printed and "nvme_read" in printed


def test_format_summary_table():
    text = format_summary(make_two_steps().summary())
    busy_s = 0.6
    GBps = 1e9 / busy_s / GB
    assert "nvme_read" in text and f"{GBps:.2f}" in text and f"{GBps / 2.0 * 100:.1f}%" in text


def test_spans_show_up_in_torch_profiler():
    prof = Profiler()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as torch_prof:
        with prof.span("unit blocks.7 forward", Link.COMPUTE):
            torch.ones(4).add_(1)
        with prof.wait(Link.NVME_READ, "wait params blocks.8"):
            pass
    keys = {event.key for event in torch_prof.key_averages()}
    assert {"unit blocks.7 forward", "wait params blocks.8"} <= keys
    assert len(prof.spans()) == 2


@pytest.mark.gpu
def test_device_span_times_the_stream_work():
    prof = Profiler()
    x = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    with prof.device_span("h2d 64 MiB", Link.H2D, stream=stream, num_bytes=x.numel()):
        with torch.cuda.stream(stream):
            y = x.to("cuda", non_blocking=True)
    (span,) = prof.spans()
    assert y.numel() == x.numel()
    assert span.end > span.start and span.num_bytes == x.numel()


def _random_run(prof, steps: int, seed: int = 0) -> None:
    """`steps` adjacent one-second steps with random spans of every kind: some crossing one or many step
    boundaries, zero-length ones on the boundaries, waits, host parts, syncs; each span recorded when it ends
    and each step when it ends, as a run records them."""
    import random

    from infinity.profile.records import Span, SpanKind
    rng = random.Random(seed)
    spans = []
    for _ in range(steps * 12):
        start = rng.uniform(-1.0, steps + 1.0)
        end = start + rng.choice([0.0, rng.uniform(0, 0.3), rng.uniform(0, 3.0)])
        kind = rng.choice(["read", "compute", "wait", "host", "sync", "edge"])
        if kind == "edge":  # (exactly on a boundary)
            start = end = float(round(start))
            spans.append(Span("edge", Link.NVME_WRITE, start, end, 3, None, SpanKind.WORK))
        elif kind == "read":
            spans.append(Span("read", Link.NVME_READ, start, end, rng.randrange(1, 100), None, SpanKind.WORK))
        elif kind == "compute":
            spans.append(Span("unit", Link.COMPUTE, start, end, 0, None, SpanKind.WORK))
        elif kind == "wait":
            spans.append(Span("wait", Link.NVME_READ, start, end, 0, None, SpanKind.WAIT))
        elif kind == "host":
            spans.append(Span(rng.choice(["data", "log", "mine"]), Link.COMPUTE, start, end, 0, None, SpanKind.HOST))
        else:
            spans.append(Span("sync (MainThread)", Link.COMPUTE, start, start, 0, None, SpanKind.SYNC))
    spans.sort(key=lambda s: s.end)
    at = 0
    for i in range(steps):
        while at < len(spans) and spans[at].end <= i + 1:
            prof._append(spans[at])
            at += 1
        prof.record_step(i + 1, float(i), float(i + 1))
    for span in spans[at:]:
        prof._append(span)


def test_the_summary_of_each_step_is_that_of_every_span_clipped_to_it():
    """The summary finds each step's spans by bisection (Note [profile window]); the reference gives every step
    every span (planted: bisect_left for the windows' begins, which drops a span ending on a step's start; and
    a scan with strict edges; both fail)."""
    from infinity.profile.summary import summarize_window
    prof = Profiler(peaks_GBps={"nvme_read": 2.0})
    _random_run(prof, 40)
    summary = prof.summary()
    spans, steps = prof.spans(), prof.steps()
    links = [Link(name) for name in summary["steps"][0]["links"]]
    reference = [summarize_window(spans, m.step, m.begin, m.end, links, prof.peaks_GBps, prof.training_thread)
                 for m in steps]
    assert summary["steps"] == reference


def test_the_profiler_keeps_the_latest_steps_and_their_spans(tmp_path):
    """keep_steps: memory bounded by the window, the summary over the latest steps equal to a full profile's
    over the same steps, every step counted (planted: no forgetting; the spans grow with the run; fails)."""
    kept, full = Profiler(keep_steps=10), Profiler()
    _random_run(kept, 200)
    _random_run(full, 200)
    assert kept.completed_steps == full.completed_steps == 200
    assert [m.step for m in kept.steps()] == list(range(191, 201))
    assert len(kept._spans) < len(full._spans) / 5  # (at most 2 x 10 steps' worth and the long spans)
    latest = kept.summary()
    assert latest["steps"] == full.summary()["steps"][-10:]
    assert latest["forgotten_steps"] == 190
    assert "10 step(s) (steps 191-200 of the run, the latest 10 kept ([profile] keep_steps))" in format_summary(latest)
    resumed = Profiler(keep_steps=10)  # (a run resumed at step 30: its profile's steps are numbered from 31)
    for step in range(31, 51):
        resumed.record_step(step, float(step), step + 1.0)
    assert ("(steps 41-50 of the run, the latest 10 kept ([profile] keep_steps); the segment since the resume at "
            "step 30)") in format_summary(resumed.summary())
    between = Profiler(keep_steps=10)  # (195 steps: 15 held since the last forgetting, the latest 10 shown)
    _random_run(between, 195)
    between.write(str(tmp_path), print_table=False)  # the trace: the shown steps' spans alone (planted: all held)
    trace = json.load(open(tmp_path / "trace.json"))
    ends = [(e["ts"] + e.get("dur", 0)) / 1e6 for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)
            if e.get("ph") == "X" and e.get("cat") != "step"]
    assert ends and min(ends) >= 185.0 - 1e-6, min(ends)
    with pytest.raises(ValueError, match="keep_steps"):
        Profiler(keep_steps=-1)
