"""The default job's peak RSS against `infinity estimate`'s prediction, with and without
`[memory] release_heap` (Note [heap release]).

Each repetition runs `infinity train` (the default job: 300 steps, validation every 100) in a fresh
process, once with `memory.release_heap=true` (the job's default) and once with false, alternating;
the summary's peak RSS (VmHWM) and predicted peak, the job's wall time and the child's CPU time
(user + system, from getrusage of the finished child) are reported per run, with medians.

    python benchmarks/bench_peak_rss.py --dir /tmp/rssbench --repeats 2 --json rss.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, median, write_json  # noqa: E402


def run(directory: str, name: str, release: bool, steps: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "infinity", "train", "--quiet", "--set", f"run.dir={directory}",
                    "--set", f"run.name={name}", "--set", f"run.steps={steps}",
                    "--set", f"memory.release_heap={'true' if release else 'false'}"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.path.join(directory, name, "summary.json")) as f:
        summary = json.load(f)
    shutil.rmtree(os.path.join(directory, name))
    measured, predicted = summary["peak_rss_bytes"], summary["predicted"]["peak_rss_bytes"]
    return {"release_heap": release, "peak_rss_MiB": measured / 2**20, "predicted_MiB": predicted / 2**20,
            "error": (predicted - measured) / measured, "wall_s": summary["seconds"],
            "user_s": after.ru_utime - before.ru_utime, "system_s": after.ru_stime - before.ru_stime,
            "last_loss": summary["last_loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="directory for the runs (removed after each)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="also write the result here")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    runs = []
    for rep in range(args.repeats):
        for release in (True, False):
            runs.append(run(args.dir, f"rep{rep}-{'release' if release else 'keep'}", release, args.steps))
            r = runs[-1]
            print(f"release_heap={str(release).lower():5s} peak {r['peak_rss_MiB']:6.0f} MiB, predicted "
                  f"{r['predicted_MiB']:6.0f} MiB ({r['error']:+.1%}); wall {r['wall_s']:.1f} s, cpu "
                  f"{r['user_s']:.1f} + {r['system_s']:.1f} s", file=sys.stderr)
    summary = {}
    for release in (True, False):
        mine = [r for r in runs if r["release_heap"] == release]
        summary["release" if release else "keep"] = {
            k: median([r[k] for r in mine]) for k in ("peak_rss_MiB", "predicted_MiB", "error", "wall_s", "user_s",
                                                      "system_s")}
    write_json(args.json, {"benchmark": "peak_rss", "steps": args.steps, "repeats": args.repeats,
                           "machine": machine(), "runs": runs, "median": summary})


if __name__ == "__main__":
    main()
