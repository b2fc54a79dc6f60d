"""The largest model the estimator says this machine trains, trained for a few steps (issue 42, item 5).

    python -m infinity estimate --largest llama --seq-len 1024 --json > largest_estimate.json
    python benchmarks/bench_largest.py --estimate largest_estimate.json --steps 3 --json largest.json

Takes the full fine-tune's answer (its rung of the ladder and the plan's `--set` lines), runs `infinity train`
with them for `--steps` steps (no checkpoint, no export) and reports its parameters, seconds per step (the median
of the steps after the first), TFLOPS (6 x parameters x trained tokens per step / step) and where its state
lives (the plan's reasons, from the run's memory report). `trained_params` is set only when the run completed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_json  # noqa: E402

from infinity.plan.largest import LADDERS, MODES  # noqa: E402


def answer(estimate_path: str, family: str, mode: str) -> dict:
    answers = json.load(open(estimate_path))
    found = next((a for a in answers if a["mode"] == mode), None)
    if found is None or found["largest"] is None:
        raise SystemExit(f"{estimate_path}: no {mode} answer fits this machine")
    rung = next(r for r in LADDERS[family] if r.name == found["largest"]["rung"])
    return {"rung": rung.name, "num_params": found["largest"]["num_params"],
            "set": rung.sets() + list(found["largest"]["set"]), "predicted_step_s": found["largest"]["step_s"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--estimate", required=True, help="infinity estimate --largest FAMILY --json's output")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = answer(args.estimate, args.family, MODES[0])
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="infinity-largest-run-")
    sets = out["set"] + [f"model.seq_len={args.seq_len}", f"run.steps={args.steps}", f"run.dir={run_dir}",
                         "run.checkpoint=false", "run.eval_every=0"]
    cmd = [sys.executable, "-m", "infinity", "train"] + [a for s in sets for a in ("--set", s)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    out.update(command=" ".join(cmd[2:]), returncode=done.returncode, stderr_tail=done.stderr[-2000:])
    summary_path = os.path.join(run_dir, "summary.json")
    if done.returncode == 0 and os.path.exists(summary_path):
        summary = json.load(open(summary_path))
        steps = [r for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()
                 for r in [json.loads(line)] if "step_time_s" in r]
        step_s = statistics.median(s["step_time_s"] for s in steps[1:] or steps)
        tokens = summary["trained_tokens_per_step"]
        report = json.load(open(os.path.join(run_dir, "memory_report.json")))
        out.update(step_s=step_s, tflops=6 * out["num_params"] * tokens / step_s / 1e12, tokens_per_step=tokens,
                   state=report.get("state"), peak_rss_bytes=summary["peak_rss_bytes"],
                   cuda_peak_bytes=report.get("cuda_peak_bytes"), trained_params=out["num_params"])
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
