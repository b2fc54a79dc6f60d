"""The GPU check's report (benchmarks/gpu_check.sh): its logs and case JSONs into one JSON, and each bar (the
offload step at its floors, the GPU's own truth: tests, sanitizer, the check's time; the memory-bound cases and
the largest model) printed as measured / bar.

    python benchmarks/gpu_check_report.py --logs $OUT --elapsed 412 --json $OUT/gpu_2026-11-27.json

Reads from `--logs`: gpu_tests.log and sanitizer.log (pytest's last line; the sanitizer's "possible data race"
reports), env.log (the device's name), case_<name>.json (bench_gpu.py's or bench_offload_bound.py's --json of
one case each), largest.json (bench_largest.py: the full fine-tune's and LoRA's 3 trained steps when they ran).
A case that did not finish (cut by its timeout) is reported as missing, never as passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_json  # noqa: E402

RACE = "CSAN detected a possible data race"
CASES = ("a", "b", "c", "d", "l", "m1", "m2", "d2")  # bench_gpu.py's and bench_offload_bound.py's
CHECK_LIMIT_S = 10 * 60  # (a 15-minute GPU window: about 10 minutes of commands after start-up and wheels)


def pytest_counts(text: str) -> dict:
    """passed / failed / skipped (errors count as failed) from pytest's summary line; {} when there is none."""
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    if not lines:
        return {}
    counts = {k: 0 for k in ("passed", "failed", "skipped")}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", lines[-1]):
        key = "failed" if word.startswith("error") else word
        if key in counts:
            counts[key] += int(n)
    return counts


def _read(path: str) -> str:
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def _case(logs: str, name: str) -> dict | None:
    path = os.path.join(logs, f"case_{name}.json")
    return json.load(open(path)).get(name) if os.path.exists(path) else None


def AT_MOST(m, x):
    return m <= x


def AT_LEAST(m, x):
    return m >= x


def SOME(m, x):
    return m > 0


def bars(report: dict) -> list[dict]:
    """Each bar: what, measured, bar, met (None: not measured)."""
    cases, out = report["cases"], []

    def bar(what, measured, limit, ok):
        out.append({"what": what, "measured": measured, "bar": limit,
                    "met": None if measured is None else bool(ok(measured, limit))})
    b, llama, d = cases.get("b"), cases.get("l"), cases.get("d")
    bar("offload floor: case b steady step / max(floors)", b and b["ratio"], 1.2, AT_MOST)
    bar("offload floor: Llama 1.12B bf16 offload shape, share of torch's speed", llama and llama["speed"], 0.55,
        AT_LEAST)
    bar("offload floor: case b with grad_clip 1.0 / without", b and b["b_clip"]["clip_over_no_clip"], 1.1, AT_MOST)
    bar("offload floor: Llama with grad_clip 1.0 / without", llama and llama["clip_over_no_clip"], 1.1, AT_MOST)
    lane = "with grad_clip 1.0 / without, device lane on"
    bar(f"offload floor: case b {lane}", b and b.get("clip_lane_over_no_clip"), 1.1, AT_MOST)
    bar(f"offload floor: Llama {lane}", llama and llama.get("clip_lane_over_no_clip"), 1.1, AT_MOST)
    bar("offload floor: case b / DeepSpeed ZeRO-3 offload_optimizer cpu", d and d["ratio"], 0.5, AT_MOST)
    m1, m2, d2 = cases.get("m1"), cases.get("m2"), cases.get("d2")
    bar("memory-bound: m1 (no tail units) steady step / max(floors)", m1 and m1["ratio"], 1.2, AT_MOST)
    bar("memory-bound: m1 share of torch's all-on-device speed", m1 and m1["speed"], 0.50, AT_LEAST)
    bar("memory-bound: m1 with grad_clip 1.0 / without", m1 and m1["clip_over_no_clip"], 1.1, AT_MOST)
    bar("memory-bound: m1 4 micro-batches accumulated, share of torch's speed", m1 and m1.get("accum4_speed"), 0.85,
        AT_LEAST)
    bar("memory-bound: m1 4 micro-batches accumulated, device lane on, share of torch's speed",
        m1 and m1.get("accum4_lane_speed"), 0.85, AT_LEAST)
    bar("memory-bound: m2 (state over 1.2x the GPU) steady step / max(floors)", m2 and m2["ratio"], 1.25, AT_MOST)
    bar("memory-bound: m1 / DeepSpeed ZeRO-2 offload_optimizer cpu", d2 and d2["ratio"], 0.5, AT_MOST)
    tests = report["gpu_tests"] or report["sanitizer_tests"]  # (the sanitizer's run is the gpu tests too)
    bar("GPU truth: gpu tests failed + skipped", tests and tests["failed"] + tests["skipped"], 0, AT_MOST)
    bar("GPU truth: sanitizer races", report["sanitizer_races"], 0, AT_MOST)
    bar("GPU truth: the check's seconds", report["elapsed_s"], CHECK_LIMIT_S, AT_MOST)
    largest = report.get("largest") or {}
    bar("GPU truth: largest model trained (parameters)", largest.get("params"), None, SOME)
    bar("GPU truth: largest model, full fine-tune steps trained in the part's time", largest.get("steps"), 3, AT_LEAST)
    bar("memory-bound: largest model trained with LoRA (parameters)", largest.get("lora_params"), None, SOME)
    bar("memory-bound: largest model, LoRA steps trained in the part's time", largest.get("lora_steps"), 3, AT_LEAST)
    bar("memory-bound: largest model trained, its state / (GPU + RAM + free disk)",
        largest.get("state_share") if largest.get("params") else None, 0.8, AT_LEAST)
    return out


def report(logs: str, elapsed_s: float | None) -> dict:
    env = _read(os.path.join(logs, "env.log"))
    device = next((line.split("device:", 1)[1].strip() for line in env.splitlines() if line.startswith("device:")),
                  None)
    sanitizer = _read(os.path.join(logs, "sanitizer.log"))
    out = {
        "device": device,
        "gpu_tests": pytest_counts(_read(os.path.join(logs, "gpu_tests.log"))) or None,
        "sanitizer_tests": pytest_counts(sanitizer) or None,
        "sanitizer_races": sanitizer.count(RACE) if pytest_counts(sanitizer).get("passed") else None,
        "cases": {name: case for name in CASES if (case := _case(logs, name)) is not None},
        "elapsed_s": elapsed_s,
    }
    largest = os.path.join(logs, "largest.json")
    out["largest"] = json.load(open(largest)) if os.path.exists(largest) else None
    out["bars"] = bars(out)
    return out


# bench_gpu's diagnostics (no bar)
INFO = ("steady_median_s", "spec_no_fire_over_no_clip", "all_cores_over_auto", "bound_over_auto", "tflops",
        "clip_lane_over_no_clip", "lane_speed", "accum4_lane_speed", "zero3_ratio")


def table(rep: dict) -> str:
    lines = [f"device: {rep['device']}", "bar | measured | limit | met"]
    for b in rep["bars"]:
        measured = "not measured" if b["measured"] is None else (
            f"{b['measured']:.3f}" if isinstance(b["measured"], float) else str(b["measured"]))
        met = {None: "-", True: "yes", False: "NO"}[b["met"]]
        lines.append(f"{b['what']} | {measured} | {b['bar']} | {met}")
    for name, case in sorted(rep["cases"].items()):
        lines += [f"case {name}: {key} = {case[key]:.3f}" for key in INFO if case.get(key) is not None]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logs", required=True)
    ap.add_argument("--elapsed", type=float, default=None, help="the check's seconds so far")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rep = report(args.logs, args.elapsed)
    print(table(rep))
    write_json(args.json, rep)
    return rep


if __name__ == "__main__":
    main()
