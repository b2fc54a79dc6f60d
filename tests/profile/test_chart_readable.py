"""The timeline PNG stays readable at any run length (Note [readable timeline]): the detail panel shows the
last steps' compute (blue) and exposed waits (red), the per-step strip and the per-unit wait bars are drawn."""

from __future__ import annotations

import pytest

from infinity.profile import chart
from infinity.profile.records import Link, Span, SpanKind, StepMark
from infinity.profile.summary import summarize

pytest.importorskip("matplotlib")
COMPUTE_RGB, WAIT_RGB = (0x4C, 0x72, 0xB0), (0xC4, 0x4E, 0x52)


def _run(steps: int):
    spans, marks = [], []
    for i in range(steps):
        t = i * 1.0
        spans.append(Span("forward before blocks.0", Link.COMPUTE, t, t + 0.4))
        spans.append(Span("backward", Link.COMPUTE, t + 0.4, t + 0.8))
        spans.append(Span("read", Link.NVME_READ, t + 0.1, t + 0.5, num_bytes=1 << 20, unit=f"blocks.{i % 3}"))
        spans.append(Span("fetch", Link.NVME_READ, t + 0.8, t + 0.9, unit=f"blocks.{i % 3}", kind=SpanKind.WAIT))
        marks.append(StepMark(i, t, t + 0.95))
    return spans, marks


def _near(pixel, rgb, tol=40) -> bool:
    return all(abs(int(a) - b) <= tol for a, b in zip(pixel[:3], rgb))


@pytest.mark.parametrize("steps", [5, 300])
def test_the_panels_show_compute_and_waits(tmp_path, steps):
    from matplotlib.image import imread
    spans, marks = _run(steps)
    path = tmp_path / "t.png"
    assert chart.draw_timeline(spans, marks, summarize(spans, marks), str(path))
    img = (imread(str(path)) * 255).astype(int)
    h = img.shape[0]
    # panel bands by height (detail on top, the strip in the middle, the per-unit waits at the bottom)
    bands = {"detail": img[: int(0.45 * h)], "strip": img[int(0.45 * h): int(0.72 * h)],
             "units": img[int(0.72 * h):]}
    for name, band in bands.items():
        counts = {c: sum(_near(p, rgb) for row in band[::3] for p in row[::3])
                  for c, rgb in (("compute", COMPUTE_RGB), ("wait", WAIT_RGB))}
        assert counts["wait"] > (20 if name == "units" else 60), (name, counts)  # more than a legend patch
        if name != "units":
            assert counts["compute"] > 200, (name, counts)
    assert chart._waits_by_unit(spans)[0][0].startswith("blocks.")
    for phase in ("forward", "backward"):  # the phase band
        rgb = tuple(int(chart._PHASE_COLORS[phase][i:i + 2], 16) for i in (1, 3, 5))
        assert sum(_near(p, rgb, 12) for row in bands["detail"] for p in row[::2]) > 200, phase  # not just the legend
    # the detail shows a few steps, not the whole run: the compute lane has visible gaps between its spans
    detail = bands["detail"]
    row = max(range(detail.shape[0]), key=lambda y: sum(_near(p, COMPUTE_RGB) for p in detail[y]))
    blue = [_near(p, COMPUTE_RGB) for p in detail[row]]
    first, last = blue.index(True), len(blue) - 1 - blue[::-1].index(True)
    gaps, run = 0, 0
    for b in blue[first:last + 1]:
        run = 0 if b else run + 1
        gaps += run == 6  # a gap at least 6 pixels wide
    assert gaps >= 2, gaps


def test_the_training_threads_host_syncs_are_counted_apart():
    """`host_syncs_training`: of a step's host syncs, those of the thread that trains (the worker's waits block
    only the worker); the headline and the chart's title say both."""
    spans = [Span("compute", Link.COMPUTE, 0.0, 1.0),
             Span("grad norm (MainThread)", Link.COMPUTE, 0.5, 0.5, kind=SpanKind.SYNC),
             Span("unit grad norm (infinity-optimizer)", Link.COMPUTE, 0.2, 0.2, kind=SpanKind.SYNC),
             Span("unit grad norm (infinity-optimizer)", Link.COMPUTE, 0.3, 0.3, kind=SpanKind.SYNC)]
    marks = [StepMark(0, 0.0, 1.0)]
    median = summarize(spans, marks, training_thread="MainThread")["median"]
    assert (median["host_syncs"], median["host_syncs_training"]) == (3, 1)
    assert "host syncs 3/step (1 training thread)" in chart._title({"rank": 0, "num_steps": 1, "median": median})
    assert summarize(spans, marks)["median"]["host_syncs_training"] is None  # (which thread trains: not known)
