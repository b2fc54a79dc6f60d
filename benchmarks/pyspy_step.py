"""Where the CPU time of a bench_step system goes: py-spy over its worker process, by thread and function.

The out-of-core step adds CPU work to the compute (I/O submission and completion, checksums, copies into
staging, the CPU Adam, Python per block, GIL hand-offs). This records `benchmarks/bench_step.py` for one
system under `py-spy record --native --threads --subprocesses` (on-CPU samples only: a thread waiting on
the disk or a lock is not sampled) and sums the samples of the system's worker process:

- per thread: its share of the samples (MainThread = forward, backward and the step's waits; the
  optimizer worker; the io_engine threads and AIO reaper; the prefetcher);
- per thread, the functions with the most samples at the top of the stack (self time; native frames
  named by library), and the infinity / io_engine functions with the most samples anywhere on the stack.

How to read it: py-spy decides "on CPU" from the Python frame, so a thread blocked in a native call (a
futex, io_getevents, a condition wait inside libc) can still be sampled: unnamed libc addresses at the
top of an io_engine thread's stack are mostly such waits, not work. Compare shares between two runs of
the same size (A/B), not against the step time.

py-spy is a profiling tool, not a dependency: `pip install py-spy`. It needs ptrace rights over the
child processes (root, or `kernel.yama.ptrace_scope = 0`). The raw collapsed stacks are kept beside the
summary for a flame graph (flamegraph.pl or speedscope.app).

    python benchmarks/pyspy_step.py --dir /tmp/spy --json spy.json
    python benchmarks/pyspy_step.py --dir /tmp/spy --system "infinity:nvme/host/nvme@optimizer.state_dtype=bf16" \
        -- --layers 12 --steps 4
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OURS = ("/infinity/", "/io_engine/")


def record(args, raw: str) -> None:
    bench = [sys.executable, os.path.join(HERE, "bench_step.py"), "--dir", os.path.join(args.dir, "disk"),
             "--systems", args.system, "--steps", str(args.steps), "--warmup", "1", "--paired-blocks", "0",
             "--io-sustained-bytes", "0", *args.bench_args]
    cmd = ["py-spy", "record", "--native", "--threads", "--subprocesses", "--rate", str(args.rate), "--format",
           "raw", "-o", raw, "--", *bench]
    done = subprocess.run(cmd)
    if done.returncode != 0:
        sys.exit(f"py-spy or bench_step failed (exit {done.returncode}): see the output above")


def worker_stacks(raw: str, system: str) -> list[tuple[str, list[str], int]]:
    """(thread name, frames from the outermost, samples) of the system's worker process (`--worker SYSTEM`;
    the I/O samples bench_step takes run in processes of their own)."""
    out, mark = [], f"--worker {system}"
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            parts = stack.split(";")
            processes = [i for i, p in enumerate(parts) if p.startswith("process ")]
            if not processes or mark not in parts[processes[-1]]:
                continue
            rest = parts[processes[-1] + 1:]
            if not rest or not rest[0].startswith("thread "):
                continue
            name = rest[0].split(":", 1)[1].strip() if ":" in rest[0] else rest[0]
            out.append((name, rest[1:], int(count)))
    return out


def summarize(stacks, top: int) -> dict:
    total = sum(n for _, _, n in stacks) or 1
    threads: dict[str, dict] = {}
    for name in sorted({t for t, _, _ in stacks}):
        mine = [(frames, n) for t, frames, n in stacks if t == name]
        samples = sum(n for _, n in mine)
        leaf, ours = collections.Counter(), collections.Counter()
        for frames, n in mine:
            if frames:
                leaf[frames[-1]] += n
            for frame in set(f for f in frames if any(o in f for o in OURS)):
                ours[frame] += n
        threads[name] = {"samples": samples, "share": samples / total,
                         "self": [(f, n / samples) for f, n in leaf.most_common(top)],
                         "inclusive_ours": [(f, n / samples) for f, n in ours.most_common(top)]}
    return {"samples": total, "threads": dict(sorted(threads.items(), key=lambda kv: -kv[1]["samples"]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="directory on the disk under test (swap, the raw stacks)")
    p.add_argument("--system", default="infinity:nvme/host/nvme", help="one bench_step system")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rate", type=int, default=100, help="samples per second per thread")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", metavar="FILE", help="also write the summary here")
    p.add_argument("bench_args", nargs="*", help="after --: more bench_step arguments (model size etc.)")
    args = p.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("py-spy is not installed: pip install py-spy (a profiling tool, not a dependency of infinity)")
    os.makedirs(args.dir, exist_ok=True)
    raw = os.path.join(args.dir, "stacks.txt")
    record(args, raw)
    stacks = worker_stacks(raw, args.system)
    if not stacks:
        sys.exit(f"{raw} holds no samples of the system's worker process: was py-spy allowed to attach to "
                 f"child processes (ptrace)?")
    summary = summarize(stacks, args.top)
    for name, t in summary["threads"].items():
        print(f"\n{name}: {t['share']:.1%} of the worker's on-CPU samples", file=sys.stderr)
        for frame, share in t["self"][:args.top]:
            print(f"  self {share:6.1%}  {frame[:150]}", file=sys.stderr)
    write_json(args.json, {"benchmark": "pyspy_step", "system": args.system, "steps": args.steps,
                           "rate": args.rate, "bench_args": args.bench_args, "raw_stacks": raw,
                           "machine": machine(), **summary})


if __name__ == "__main__":
    main()
