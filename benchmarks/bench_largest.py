"""The largest model the estimator says this machine trains, trained for a few steps: full fine-tuning and LoRA.

    python -m infinity estimate --largest llama --seq-len 1024 --json > largest_estimate.json
    python benchmarks/bench_largest.py --estimate largest_estimate.json --steps 3 --json largest.json
    (with the job's own `--set` lines, e.g. nvme.paths or run.batch_size, given to both: `--set KEY=VALUE`)

Full fine-tuning: the answer's rung and the plan's `--set` lines run as `infinity train` for `--steps` steps (no
checkpoint, no export). LoRA: the LoRA answer's rung (a pretrained model of that shape, LoRA r = 16) with its
plan's `--set` lines, run by the engine directly for `--steps` steps on random base weights (a model that large
has no weights on this disk, and their values do not change the step's time). Each reports its parameters,
seconds per step (the median of the steps after the first), TFLOPS (6 x parameters x trained tokens per step /
step), where its state lives, and the process's peak RSS. `params` (and `lora_params`) is set only when the run
trained at least one step and ended cleanly; `steps_done` says how many; `step_s` is the full fine-tune's;
`wall_s` each mode's whole time (its start-up and materializing the model included; LoRA's `start_s` that part).

`--time-limit S`: each mode's wall-clock budget, its start-up included. The full fine-tune gets it as
`run.time_limit` (Note [time limit]: it stops after the last step that leaves room for one more), and is stopped
(SIGTERM, then SIGKILL) if it runs past the budget anyway; LoRA takes no step it expects to end past it. The steps
done are reported either way, and a SIGTERM to this script (a `timeout` around it) stops the training process,
not leaving it to hold the GPU and the disk, and still writes the JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_json  # noqa: E402

from infinity.plan.largest import MODES, Rung  # noqa: E402

PRETRAINED = "model.pretrained="


def answer(estimate_path: str, mode: str) -> dict:
    answers = json.load(open(estimate_path))
    found = next((a for a in answers if a["mode"] == mode), None)
    if found is None or found["largest"] is None:
        raise SystemExit(f"{estimate_path}: no {mode} answer fits this machine")
    rung = Rung(**found["largest"]["shape"])  # (a ladder's rung, or a shape between two: Note [largest model])
    return {"rung": rung.name, "shape": found["largest"]["shape"], "num_params": found["largest"]["num_params"],
            "set": rung.sets() + list(found["largest"]["set"]), "predicted_step_s": found["largest"]["step_s"],
            "state_bytes": found["largest"].get("state_bytes"), "free_bytes": found["largest"].get("free_bytes")}


STARTUP_S = 15.0
"""Of a mode's --time-limit, kept back for the training process's start (imports) and its end (the report)."""


def run_bounded(cmd: list[str], limit_s: float | None, grace_s: float = 30.0) -> tuple[int, str]:
    """`cmd`'s return code and stderr; past `limit_s` (None: no limit) it gets SIGTERM (a clean stop), then
    SIGKILL `grace_s` later. Its own process group, stopped as well when this script is (SIGTERM, Ctrl-C)."""
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        try:
            _, err = child.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                _, err = child.communicate(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                _, err = child.communicate()
            err += f"\n(stopped: past the {limit_s:.0f} s limit)"
    finally:
        if child.poll() is None:  # (this script was stopped: take the training process down with it)
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    return child.returncode, err


def full_fine_tune(args, run_dir: str) -> dict:
    """The full fine-tune's answer, trained by `infinity train`."""
    out = answer(args.estimate, MODES[0])
    sets = args.set + out["set"] + [f"model.seq_len={args.seq_len}", f"run.steps={args.steps}", f"run.dir={run_dir}",
                         "run.checkpoint=false", "run.eval_every=0"]
    if args.time_limit is not None:
        sets.append(f"run.time_limit={max(1, int(args.time_limit - STARTUP_S))}s")
    cmd = [sys.executable, "-m", "infinity", "train"] + [a for s in sets for a in ("--set", s)]
    began = time.monotonic()
    try:
        returncode, stderr = run_bounded(cmd, args.time_limit)
    except KeyboardInterrupt as e:  # (this script stopped, and the training with it: what it did is reported)
        returncode, stderr, out["stopped_by"] = None, "", str(e)
    out.update(wall_s=time.monotonic() - began, command=" ".join(cmd[2:]), returncode=returncode,
               stderr_tail=stderr[-2000:])
    found = sorted(glob.glob(os.path.join(run_dir, "*", "metrics.jsonl")))  # (run.dir holds one run per start)
    if not found:
        return out
    run_dir = os.path.dirname(found[-1])
    steps = [r["step_time_s"] for line in open(found[-1]) if line.strip()
             for r in [json.loads(line)] if "step_time_s" in r]
    out.update(steps_done=len(steps), step_times_s=steps)
    summary_path = os.path.join(run_dir, "summary.json")
    if not steps or not os.path.exists(summary_path):
        return out
    summary = json.load(open(summary_path))
    step_s = statistics.median(steps[1:] or steps)
    tokens = summary["trained_tokens_per_step"]
    out.update(step_s=step_s, tflops=6 * out["num_params"] * tokens / step_s / 1e12, tokens_per_step=tokens,
               peak_rss_bytes=summary["peak_rss_bytes"], stopped_by=summary.get("stopped_by", out.get("stopped_by")))
    report_path = os.path.join(run_dir, "memory_report.json")
    if os.path.exists(report_path):
        report = json.load(open(report_path))
        out.update(state=report.get("state"), cuda_peak_bytes=report.get("cuda_peak_bytes"))
    if returncode == 0 or "run.time_limit" in str(summary.get("stopped_by")):  # (the limit's stop exits 130)
        out["trained_params"] = out["num_params"]
    return out


def lora(args, root: str, began: float) -> dict:
    """The LoRA answer's rung, its plan's engine config, `--steps` steps on random base weights (in this process);
    `began`: the mode's start (time.monotonic), whence --time-limit counts."""
    import resource

    import torch
    from bench_gpu import fast_init

    import infinity
    from infinity.job.prediction import reserve_activations
    from infinity.job.spec import load_job
    from infinity.models.build import build_model
    out = answer(args.estimate, MODES[1])
    rung = Rung(**out["shape"])
    path = rung.pretrained(root, args.seq_len)  # (its config.json: the estimate's directory is gone)
    sets = args.set + [s for s in out["set"] if not s.startswith(PRETRAINED) and not s.startswith("model.kind")
            and not any(s.startswith(f"model.{k}=") for k in ("d_model", "n_layer", "n_head", "n_kv_head",
                                                                "ffn_dim", "vocab_size"))]
    sets += [PRETRAINED + path, "model.lora.r=16", f"model.seq_len={args.seq_len}", f"run.dir={root}/run",
             "run.checkpoint=false"]  # (no checkpoint is saved: none shares the disk, as the estimate judged it)
    out["set"] = sets
    job = load_job(None, sets)
    bundle = build_model(job.model, job.lora)
    # (the activations traced and reserved as `infinity train` does: the plan the estimate judged)
    config = reserve_activations(job, job.engine_config(os.path.join(root, "run")), 1, torch.cuda.is_available())
    for swap in job.created_swap(os.path.join(root, "run")):
        os.makedirs(swap, exist_ok=True)  # (as `infinity train` makes its run's swap)
    base = bundle.model.get_base_model()
    engine = infinity.initialize(bundle.model, config, init_fn=fast_init(base._init_weights))
    out["start_s"] = time.monotonic() - began  # (the model built and materialized: before the first step)
    deadline = None if args.time_limit is None else began + args.time_limit
    g = torch.Generator().manual_seed(0)
    accum = config.train.grad_accum_steps
    x = torch.randint(0, rung.vocab_size, (job.run.batch_size, args.seq_len + 1), generator=g)
    times, state = [], None
    with engine:
        try:
            for _ in range(args.steps):
                if deadline is not None and times and time.monotonic() + max(times) > deadline:
                    out["stopped_by"] = f"--time-limit {args.time_limit:.0f}"  # (the next step would end past it)
                    break
                start = time.perf_counter()
                for _ in range(accum):
                    engine.backward(bundle.loss(engine, x[:, :-1], x[:, 1:]))
                    engine.step()
                engine.synchronize()
                times.append(time.perf_counter() - start)
            state = engine.memory_report().get("state")
        except KeyboardInterrupt as e:  # (stopped from outside: the steps done are the result)
            out["stopped_by"] = str(e)
    out.update(step_times_s=times, steps_done=len(times), wall_s=time.monotonic() - began,
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if times:
        step_s = statistics.median(times[1:] or times)
        tokens = job.run.batch_size * args.seq_len * accum
        trainable = sum(p.numel() for p in bundle.model.parameters() if p.requires_grad)
        out.update(step_s=step_s, tflops=6 * out["num_params"] * tokens / step_s / 1e12, tokens_per_step=tokens,
                   trainable_params=trainable, state=state, trained_params=out["num_params"])
    return out


def _stopped(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--estimate", required=True, help="infinity estimate --largest FAMILY --json's output")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="the job's own --set lines, as `infinity estimate --largest` was given them (before the "
                         "answer's)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--modes", default="full,lora", help="full, lora or both (comma-separated)")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="each mode's wall-clock budget in seconds, its start-up included (default: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _stopped)  # (a `timeout` around this script: stop the training, write the JSON)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="infinity-largest-run-")
    out: dict = {}
    if "full" in args.modes:
        out["full"] = full = full_fine_tune(args, run_dir)
        out.update(params=full.get("trained_params"), step_s=full.get("step_s"), steps=full.get("steps_done"),
                   state_share=full["state_bytes"] / full["free_bytes"] if full.get("free_bytes") else None)
        print(f"full fine-tune: {json.dumps(full, default=str)[:2000]}", flush=True)
    if "lora" in args.modes and not str((out.get("full") or {}).get("stopped_by")).startswith("signal"):
        began = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="infinity-largest-lora-") as root:
            try:
                out["lora"] = lora(args, root, began)
            except Exception as e:  # noqa: BLE001 - recorded and printed, not swallowed: the full run's numbers stay
                traceback.print_exc()
                out["lora"] = {"error": repr(e)}
        out["lora_params"], out["lora_steps"] = out["lora"].get("trained_params"), out["lora"].get("steps_done")
        print(f"LoRA: {json.dumps(out['lora'], default=str)[:2000]}", flush=True)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
