"""Step time of infinity beside plain PyTorch, DeepSpeed ZeRO-3 and FSDP2, on the same model and batch.

    python benchmarks/bench_step.py --dir /path/on/nvme --json step.json
    python benchmarks/bench_step.py --systems torch,infinity:nvme/host/nvme --steps 4
    python benchmarks/bench_step.py --dir /path/on/nvme --device-budget 2GiB --host-budget 2GiB \
        --systems infinity:auto,infinity:fitting --json auto.json     # auto vs the best static placement
    python benchmarks/bench_step.py --world 2 --systems \
        infinity:device/host/host@2,infinity:device/host/host@3,deepspeed:cpu_opt@2,fsdp2:cpu_both  # issue 23

Every system runs in its own process (so its peak RSS is its own), world size 1
unless `--world N` (then N processes under torchrun, gloo on the CPU, `--threads`
per rank: default 2 // N; each rank its own batches; rank 0's step times are reported,
every rank's peak RSS), the same GPT, data, AdamW hyper-parameters, gradient clipping
and thread count.
Reported per system: median step time over the timed steps (after warm-up; a step
runs from its start to the next one's, so infinity's overlapped update is paid by
the step it overlaps, and infinity runs one untimed step more and then drains its
update: `tail_s`),
peak RSS, overlap efficiency (infinity's profiler, when enabled), bytes moved per
step, and the ratio to the in-RAM PyTorch baseline. With infinity on NVMe the
floors are computed in the same run: the compute floor is infinity with all state
on the device tier; the I/O floor is the bytes the plan moves per step over
io_engine's read and write bandwidth, measured on the same directory in this run
(reads and writes share the disk, so the floor adds the two times): the median of
samples taken at the start and right after each infinity placement on NVMe, since
a shared disk's speed drifts within minutes (the first sample's floor is reported too).
Beside it, not instead of it: the floor from a sustained sample (4 GiB each way in
64 MiB requests, `io_floor_sustained_s`), what the disk did during the timed steps
(`disk`: its busy fraction and rates, from the kernel's counters), and the paired
floor (`paired`, `--paired-blocks`; run_paired): the system's steps run again in a
process of their own, each between two burst samples taken seconds before and after
it, each step over the floor of its own samples, the median of those ratios.

System names: `torch`, `infinity:PARAMS/GRADS/OPTIMIZER` (tiers), `infinity:auto`
(`placement.policy = "auto"`; its plan, tier counts per state kind and reasons are
recorded), `infinity:fitting` (expanded by the driver, before any worker starts, into
every static placement `infinity:P/G/O` whose plan fits the budgets, planned on the
meta device by the planner `initialize` uses; the others are listed with the
planner's reason, not run), `deepspeed:OFFLOAD` and `fsdp2:OFFLOAD` with OFFLOAD one
of none | cpu_opt | cpu_both | nvme_opt | nvme_both. DeepSpeed and FSDP2 are skipped
(with the reason) when not installed or failing; an infinity placement that does not
fit fails with the planner's message.

ZeRO stages: a system name ending in `@S` runs at stage S (`infinity:device/host/host@2`:
`zero.stage = 2`; `deepspeed:cpu_opt@2`: DeepSpeed ZeRO-2 with the optimizer on the CPU,
i.e. ZeRO-Offload; DeepSpeed offloads parameters only at stage 3); `--zero-stage S` is
the stage of every infinity and DeepSpeed system without a suffix (default: infinity's
`zero.stage` default, DeepSpeed stage 3). FSDP2 is always fully sharded (stage 3) and
`torch` at `--world` > 1 is DDP. With stage suffixes in the run, `stage_ratios` compares
each infinity `@2` system with its `@3` twin, with `deepspeed:cpu_opt@2` and with
`fsdp2:cpu_both` (issue 23's bar: stage 2 faster than stage 3, <= 0.8 x ZeRO-2 offload).
A `@KEY=VALUE` suffix sets one engine key for that system only: the default systems include
`infinity:nvme/host/nvme@optimizer.state_dtype=bf16` (16-bit optimizer moments, docs/bytes.md), whose
`bytes_moved_per_step` and step sit beside the fp32 state's `infinity:nvme/host/nvme`.

`--device-budget` / `--host-budget` set infinity's `memory.device_budget` /
`memory.host_budget` (default "auto": the free memory detected). Without a GPU the
device tier is RAM too, so both are needed to make everything-on-device not fit.
With `infinity:auto` the payload's `auto_vs_static` compares auto's step with the
best static placement that fits (issue 5's bar: a ratio <= 1.10). `AUTO_BUDGETS`,
2GiB / 2GiB, suit the default 311M-parameter model (fp32: 1.16 GiB of parameters,
1.16 GiB of gradients, 3.47 GiB of optimizer state): everything on host needs
5.79 GiB of host, everything on device 6.06 GiB of device, and the 7 placements
that fit all keep the optimizer state on NVMe (device/host, host/device,
device/nvme, host/nvme, nvme/device, nvme/host and nvme/nvme for params/grads);
auto mixes tiers per unit. They are the default when `infinity:auto` or
`infinity:fitting` is asked for without budgets (`--device-budget auto --host-budget
auto` for the free memory detected).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from step_floors import floors_of, io_median, on_nvme, paired_name, peer_ratios, run_io_floor, run_paired, stage_ratios  # noqa: E402  (after the path)
from step_systems import (  # noqa: E402
    STATIC_PLACEMENTS,
    infinity_config,
    model_config,
    rank,
    run_deepspeed,
    run_fsdp2,
    run_infinity,
    run_torch,
)

DEFAULT_SYSTEMS = [
    "torch",
    "infinity:device/device/device", "infinity:device/device/host", "infinity:host/host/host",
    "infinity:device/host/nvme", "infinity:nvme/host/nvme",
    "infinity:nvme/host/nvme@optimizer.state_dtype=bf16",  # 8 of the 12 optimizer bytes (docs/bytes.md)
    "deepspeed:none", "deepspeed:cpu_opt", "deepspeed:cpu_both", "deepspeed:nvme_opt", "deepspeed:nvme_both",
    "fsdp2:none", "fsdp2:cpu_both",
]
AUTO_BUDGETS = ("2GiB", "2GiB")  # --device-budget, --host-budget for the default model (docstring)


def worker(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    system, _, option = args.worker.partition(":")
    fn = {"torch": lambda: run_torch(args), "infinity": lambda: run_infinity(args, option),
          "deepspeed": lambda: run_deepspeed(args, option), "fsdp2": lambda: run_fsdp2(args, option),
          "io": lambda: run_io_floor(args), "paired": lambda: run_paired(args, option)}[system]
    return fn()


# ----------------------------------------------------------------------------------------- driver
def fitting_placements(args) -> dict:
    """Which static uniform placements fit the budgets, decided as `initialize` decides it.

    The model is built on the meta device and split into units as `initialize` splits it
    (`infinity.plan.estimate.unit_sizes_of`); the budgets are resolved as the engine resolves them
    (`memory.*_budget`, the free memory detected now, the free space of the swap directory's
    filesystem); each of the 27 placements is planned by `plan_for_config`. Returns
    {"fitting": [P/G/O, ...], "not_fitting": {P/G/O: the planner's message}, "budgets": {...}}.
    """
    import dataclasses

    import torch

    import infinity
    from infinity.machine.preflight import check_nvme_paths
    from infinity.memory.placement import plan_for_config
    from infinity.memory.plan import PlacementError
    from infinity.models.gpt import GPT
    from infinity.plan.estimate import resolve_budgets_for, unit_sizes_of
    with infinity.meta_init():
        model = GPT(model_config(args))
    base = infinity.Config.from_dict(infinity_config(args, "auto", args.dir))
    sizes = unit_sizes_of(model, base, world_size=args.world)
    # each worker's swap directory is a fresh directory under --dir: the same filesystem, the same free space
    budgets = resolve_budgets_for(base, local_world_size=args.world, cuda=torch.cuda.is_available(),
                                  nvme_free=check_nvme_paths([args.dir]))
    fitting, not_fitting = [], {}
    for placement in STATIC_PLACEMENTS:
        config = infinity.Config.from_dict(infinity_config(args, placement, args.dir))
        try:
            plan_for_config(sizes, config, budgets)
            fitting.append(placement)
        except PlacementError as e:
            not_fitting[placement] = str(e)
    return {"fitting": fitting, "not_fitting": not_fitting, "budgets": dataclasses.asdict(budgets)}


def expand_systems(systems: list[str], fit: dict | None) -> list[str]:
    """`infinity:fitting` replaced by every fitting static placement (in order, without duplicates)."""
    out = []
    for name in systems:
        names = [f"infinity:{p}" for p in fit["fitting"]] if name == "infinity:fitting" else [name]
        out += [n for n in names if n not in out]
    return out


def drive(args) -> dict:
    from common import machine, write_json
    args.dir = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="bench-step-"))
    os.makedirs(args.dir, exist_ok=True)
    requested = args.systems.split(",") if args.systems else DEFAULT_SYSTEMS
    fit = None
    if "infinity:auto" in requested or "infinity:fitting" in requested:
        if not args.device_budget and not args.host_budget:
            args.device_budget, args.host_budget = AUTO_BUDGETS
            print(f"budgets: --device-budget {AUTO_BUDGETS[0]} --host-budget {AUTO_BUDGETS[1]} (the default with "
                  f"infinity:auto / infinity:fitting)", flush=True)
        fit = fitting_placements(args)
        print(f"budgets: device {_gib(fit['budgets']['device'])}, host {_gib(fit['budgets']['host'])}, "
              f"nvme {_gib(fit['budgets']['nvme'])}; static placements that fit: "
              f"{', '.join(fit['fitting']) or 'none'}", flush=True)
    systems = expand_systems(requested, fit)
    if args.profile:  # the profile's per-link peaks are the link rates cached for this disk (measured once)
        from infinity.machine.link_rates import link_rates
        rates = link_rates(args.dir)
        print(f"link rates ({rates.source}): nvme read {rates.nvme_read / 1e9:.2f} GB/s, write "
              f"{rates.nvme_write / 1e9:.2f} GB/s, cpu adam {rates.cpu_adam / 1e9:.2f} Gelem/s", flush=True)
    results = {}
    io_samples = []
    # the disk's speed drifts by up to 2x within minutes here: the I/O floor uses the median of
    # samples taken at the start and right after each infinity run on NVMe, not one sample
    # and, with --paired-blocks, its steps bracketed by samples seconds away (run_paired)
    runs = ["io"]
    for name in systems:
        runs.append(name)
        if on_nvme(name):  # the paired floor's steps run alone: one process
            runs += ["io"] + ([paired_name(name)] if args.paired_blocks and args.world == 1 else [])
    for name in runs:
        result = _run_worker(name, args)
        if name == "io":
            io_samples.append(result)
            results["io"] = io_median(io_samples)
        else:
            results[name] = result
        if "step_s" in result:
            shown = f"{result['step_s']:.3f} s/step  rss {result['peak_rss_GiB']:.2f} GiB"
        elif "steps" in result:
            shown = "steps " + " ".join(f"{x['step_s']:.3f}" for x in result["steps"]) + " s, bracketed by samples"
        else:
            shown = str(result)[:160]
        print(f"{name:32s} {shown}", flush=True)
    base = results.get("torch", {}).get("step_s")
    for name, r in results.items():
        if base and r.get("step_s"):
            r["ratio_to_torch"] = round(r["step_s"] / base, 3)
    floors = floors_of(results)
    ratios = peer_ratios(results)
    payload = {"benchmark": "step", "machine": machine(), "model": vars(model_config(args)),
               "params": model_config(args).num_params(), "batch": args.batch, "clip": args.clip,
               "threads": args.threads, "world": args.world, "zero_stage": args.zero_stage,
               "stage_ratios": stage_ratios(results), "device_budget": args.device_budget or "auto",
               "host_budget": args.host_budget or "auto", "systems": systems, "results": results, "floors": floors,
               "peer_ratios": ratios}
    if fit is not None:
        payload["auto_vs_static"] = auto_vs_static(results, fit)
    write_json(args.json, payload)
    if fit is not None:
        _print_auto_vs_static(payload["auto_vs_static"])  # after the JSON, so it is what the terminal shows last
    for label, r in payload["stage_ratios"].items():
        print(f"{label:60s} {r['step_ratio']:.3f}" + (f"  (bar {r['bar']}: {'met' if r['met'] else 'NOT met'})"
                                                      if "bar" in r else ""))
    return payload


def auto_vs_static(results: dict, fit: dict) -> dict:
    """Issue 5's bar: auto fits, and its step is within 10% of the best static placement that fits."""
    static = {}
    for placement in fit["fitting"]:
        r = results.get(f"infinity:{placement}")
        if r is not None:
            static[placement] = {"step_s": r.get("step_s")} if "step_s" in r else {"error": r.get("error")}
    timed = {p: r["step_s"] for p, r in static.items() if r.get("step_s")}
    best = min(timed, key=timed.get) if timed else None
    auto = results.get("infinity:auto", {})
    auto_s = auto.get("step_s")
    ratio = auto_s / timed[best] if auto_s and best else None
    return {"budgets": fit["budgets"], "fitting": static,
            "fitting_not_run": [p for p in fit["fitting"] if p not in static],
            "not_fitting": fit["not_fitting"], "best_static": best, "best_static_step_s": timed.get(best),
            "auto_fits": "step_s" in auto, "auto_error": auto.get("error"), "auto_step_s": auto_s,
            "auto_plan": auto.get("plan"), "ratio_auto_to_best": round(ratio, 3) if ratio else None,
            "within_10pct": ratio <= 1.10 if ratio else None}


def _print_auto_vs_static(a: dict) -> None:
    print(f"auto vs static ({len(a['fitting'])} static placements fit and ran, {len(a['not_fitting'])} do not fit):")
    for placement, r in sorted(a["fitting"].items(), key=lambda kv: kv[1].get("step_s") or float("inf")):
        outcome = f"{r['step_s']:.3f} s/step" if r.get("step_s") else f"failed: {r['error']}"[:160]
        print(f"  {placement:24s} " + outcome)
    if a["auto_fits"]:
        plan = a["auto_plan"] or {}
        counts = "; ".join(f"{g} " + ", ".join(f"{n} on {t}" for t, n in c.items())
                           for g, c in plan.get("tier_counts", {}).items())
        print(f"  {'auto':24s} {a['auto_step_s']:.3f} s/step  plan: {counts}")
    else:
        print(f"  auto failed: {a['auto_error']}")
    if a["ratio_auto_to_best"] is not None:
        verdict = "within" if a["within_10pct"] else "NOT within"
        print(f"  auto / best static ({a['best_static']}) = {a['ratio_auto_to_best']:.3f}: {verdict} 10%")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _run_worker(name: str, args) -> dict:
    """Run one system (or the I/O measurement) in its own process, or `--world` processes under torchrun
    (each rank writes its result to a file of its own: long lines of several ranks would interleave on
    one pipe); rank 0's result with every rank's peak RSS, or an error."""
    distributed = args.world > 1 and name.partition(":")[0] not in ("io", "paired")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world}"]
    cmd = (launcher if distributed else [sys.executable]) + [os.path.abspath(__file__), "--worker", name]
    cmd += _forward(args)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as ranks:
        env = {**os.environ, RESULT_DIR: ranks} if distributed else None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.timeout} s"}
        if distributed:
            per_rank = [_read_json(os.path.join(ranks, f"rank{r}.json")) for r in range(args.world)]
            result = per_rank[0] if all(per_rank) and proc.returncode == 0 else None
            if result is not None:
                result["peak_rss_GiB_per_rank"] = [r.get("peak_rss_GiB") for r in per_rank]
                result["step_s_per_rank"] = [r.get("step_s") for r in per_rank]
        else:
            line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
            result = json.loads(line[len("RESULT "):]) if proc.returncode == 0 and line is not None else None
    if result is None:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        # under torchrun the last lines are its failure summary: end at the worker's own exception instead
        exception = re.compile(r"(\[rank\d+\]: )?[\w.]+(Error|Exception|Interrupt)\b")
        raised = [i for i, ln in enumerate(lines) if exception.match(ln) and "ChildFailedError" not in ln]
        tail = lines[max(0, raised[-1] - 5):raised[-1] + 1] if distributed and raised else lines[-6:]
        result = {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    result["wall_s"] = round(time.perf_counter() - t, 1)
    return result


RESULT_DIR = "BENCH_STEP_RESULT_DIR"  # set by the driver for a torchrun worker: where each rank writes its result


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _forward(args) -> list[str]:
    out = []
    for key in ("layers", "d_model", "heads", "vocab", "seq", "batch", "steps", "warmup", "lr", "clip", "threads",
                "units_ahead", "io_bytes", "io_sustained_bytes", "paired_blocks", "ds_param_buffers", "world"):
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    out += ["--dir", args.dir]
    for key in ("device_budget", "host_budget"):
        if getattr(args, key):
            out += [f"--{key.replace('_', '-')}", getattr(args, key)]
    if args.profile:
        out.append("--profile")
    if args.no_overlap:
        out.append("--no-overlap")
    if args.zero_stage is not None:
        out += ["--zero-stage", str(args.zero_stage)]
    for item in args.set:
        out += ["--set", item]
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="", help="comma-separated (default: all); infinity:auto and infinity:fitting "
                                                  "(every static placement that fits the budgets) compare auto")
    ap.add_argument("--dir", default=None, help="directory on the disk under test (swap files, traces)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6,
                    help="timed steps (infinity runs one more, untimed, then drains: tail_s)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2, help="threads per process (default 2; with --world N and no "
                                                           "--threads, 2 // N, at least 1)")
    ap.add_argument("--world", type=int, default=1, metavar="N",
                    help="ranks per system: N torchrun processes, gloo on the CPU (default 1)")
    ap.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3), metavar="S",
                    help="ZeRO stage of the infinity systems (--set zero.stage=S) and DeepSpeed's (default 3) "
                         "without an @S suffix")
    ap.add_argument("--units-ahead", type=int, default=2)
    ap.add_argument("--io-bytes", type=int, default=1 << 30, help="the burst I/O sample's size (the I/O floor's)")
    ap.add_argument("--io-sustained-bytes", type=int, default=4 << 30,
                    help="the sustained I/O sample's size, each way (0: none); reported beside the I/O floor")
    ap.add_argument("--paired-blocks", type=int, default=4,
                    help="steps of each infinity system on NVMe run again, each bracketed by burst I/O samples "
                         "taken seconds before and after it (0: none); their median ratio to the floor is "
                         "reported beside the I/O floor's")
    ap.add_argument("--device-budget", default=None, metavar="SIZE",
                    help='infinity\'s memory.device_budget, e.g. "2GiB" (default "auto": the free memory '
                         'detected; with infinity:auto / infinity:fitting, AUTO_BUDGETS)')
    ap.add_argument("--host-budget", default=None, metavar="SIZE",
                    help='infinity\'s memory.host_budget, e.g. "2GiB" (default as --device-budget)')
    ap.add_argument("--ds-param-buffers", type=int, default=32,
                    help="DeepSpeed offload_param buffer_count (32, docs/benchmarks.md: each parameter, however small,"
                         " takes one buffer of the largest parameter's size)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="engine config key for the infinity systems, e.g. --set io.checksum=full (repeatable)")
    ap.add_argument("--profile", action="store_true", help="enable infinity's profiler (overlap efficiency)")
    ap.add_argument("--no-overlap", action="store_true", help="infinity without the optimizer worker")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.world > 1 and not any(a == "--threads" or a.startswith("--threads=") for a in argv):
        args.threads = max(1, 2 // args.world)  # the same threads per rank for every system (docs/benchmarks.md)
    if args.worker:
        result = json.dumps(worker(args), default=str)
        if os.environ.get(RESULT_DIR):  # one of --world ranks (torchrun)
            with open(os.path.join(os.environ[RESULT_DIR], f"rank{rank()}.json"), "w") as f:
                f.write(result)
        else:
            print("RESULT " + result, flush=True)
        return None
    return drive(args)


if __name__ == "__main__":
    main()
