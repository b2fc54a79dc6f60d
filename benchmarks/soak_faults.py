"""The fault soak behind `bench_soak.py --faults`: nothing is lost to a full disk or a killed job.

    python benchmarks/bench_soak.py --faults [--steps 300] [--kills 5] [--json out.json]   # as root

1. An undisturbed run: `--steps` steps of a small GPT, parameters and optimizer state on NVMe
   (swap files), a background checkpoint every `SAVE_EVERY` steps; its final parameters are the
   reference.
2. The same run on a small tmpfs (the run directory: swap and checkpoints) while
   - a filler process writes that filesystem full (ENOSPC) and frees it again, over and over;
   - the job is SIGKILLed `--kills` times at seeded steps and started again, each time resuming
     from its newest complete checkpoint.
   A save that fails for space is reported by the engine (CheckpointError at the next backward or
   step, which did nothing and is called again: tests/state/test_checkpoint_safety.py); the run goes on
   and the earlier checkpoints stay.
3. The final parameters must equal the reference bit for bit. RSS and open fds are sampled every
   step in every process: the report gives, per process, the first sample after warm-up and the last.

The worker is this file run as a script: `soak_faults.py worker ROOT OUT PROGRESS STEPS`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

SAVE_EVERY = 10
WARMUP = 5  # steps of a process before its RSS / fds samples count
TMPFS_SIZE = "48m"

FILLER = r"""
import errno, os, random, sys, time
mnt, stop, log = sys.argv[1:4]
rng = random.Random(7)
episodes = 0
while not os.path.exists(stop):
    time.sleep(rng.uniform(0.2, 1.0))
    path = os.path.join(mnt, f"fill-{episodes}")
    try:
        with open(path, "wb") as f:
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    episodes += 1
    with open(log, "w") as f:
        f.write(str(episodes))
    time.sleep(rng.uniform(0.2, 1.0))  # the disk stays full for a while
    try:
        os.remove(path)
    except FileNotFoundError:  # unmounted under us: the soak is over
        break
"""


# ------------------------------------------------------------------------------- the job
# a start refused while the filler holds the disk: the plan's check, or the swap file's reservation when the disk
# filled between the plan and the reservation (both name the missing bytes and the fix)
START_REFUSED = ("PlacementError", "IOEngineError: not enough disk space for swap file")


def _worker(root: str, out: str, progress: str, steps: int) -> None:
    import psutil
    import torch

    import infinity
    import infinity.state.checkpoint as ckpt
    from infinity.models.gpt import GPT, GPTConfig, gpt_init, synthetic_batch
    from infinity.state.checkpoint_load import read_manifest

    cfg = GPTConfig(vocab_size=512, seq_len=64, n_layer=4, n_head=4, d_model=128)
    from pathlib import Path

    from infinity.job.run_dir import RunDir
    swap, ckpts = os.path.join(root, "swap"), os.path.join(root, "ckpt")
    os.makedirs(swap, exist_ok=True)
    run = RunDir.existing(Path(root))  # as `infinity train --resume`: locked, a killed job's swap files removed
    config = {"optimizer": {"lr": 1e-3, "grad_clip": 1.0}, "nvme": {"paths": [swap]},
              "placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"},
              "checkpoint": {"keep_last": 2, "background": True}, "train": {"seed": 0}}
    with infinity.meta_init():
        model = GPT(cfg)
    engine = infinity.initialize(model, config, init_fn=gpt_init)
    start, resumed = 0, None
    found = []
    for name in os.listdir(ckpts) if os.path.isdir(ckpts) else []:
        try:
            found.append((read_manifest(os.path.join(ckpts, name))["user_state"]["next_step"], name))
        except ckpt.CheckpointError:
            pass  # an incomplete save (killed, or the disk was full): never loaded
    if found:
        start, name = max(found)
        resumed = os.path.join(ckpts, name)
        assert engine.load_checkpoint(resumed)["next_step"] == start
    proc = psutil.Process()
    failed_saves = []

    def again(call, *args):
        try:
            return call(*args)
        except ckpt.CheckpointError as e:  # a background save failed: the call did nothing, do it again
            failed_saves.append(str(e)[:200])
            return call(*args)

    with open(progress, "a") as log:
        log.write(json.dumps({"event": "start", "pid": os.getpid(), "step": start, "resumed": resumed}) + "\n")
        for step in range(start, steps):
            x, y = synthetic_batch(cfg, 4, torch.Generator().manual_seed(1000 + step))
            again(engine.backward, engine(x, y))
            again(engine.step)
            if (step + 1) % SAVE_EVERY == 0:
                try:
                    engine.save_checkpoint(os.path.join(ckpts, f"step-{step + 1:05d}"),
                                           user_state={"next_step": step + 1})
                except ckpt.CheckpointError as e:  # no room to even begin it
                    failed_saves.append(str(e)[:200])
            log.write(json.dumps({"step": step + 1, "rss_MiB": round(proc.memory_info().rss / 2**20, 1),
                                  "open_fds": proc.num_fds(), "failed_saves": len(failed_saves)}) + "\n")
            log.flush()
        try:
            engine.wait_for_checkpoint()
        except ckpt.CheckpointError as e:
            failed_saves.append(str(e)[:200])
        state = engine.full_state_dict()
        engine.close()
        run.release()
        torch.save(state, out)
        log.write(json.dumps({"event": "done", "failed_saves": failed_saves}) + "\n")


# ------------------------------------------------------------------------------- the soak
def _records(progress: str) -> list[dict]:
    if not os.path.exists(progress):
        return []
    out = []
    with open(progress) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line a killed process left half-written
    return out


def _segments(records: list[dict]) -> list[dict]:
    """Per process: its start step, and RSS / fds after warm-up (first and last sample)."""
    segs, cur = [], None
    for r in records:
        if r.get("event") == "start":
            cur = {"pid": r["pid"], "from_step": r["step"], "samples": []}
            segs.append(cur)
        elif "rss_MiB" in r and cur is not None:
            cur["samples"].append(r)
    out = []
    for s in segs:
        after = s["samples"][WARMUP:]
        entry = {"pid": s["pid"], "from_step": s["from_step"],
                 "to_step": s["samples"][-1]["step"] if s["samples"] else s["from_step"]}
        if after:
            entry |= {"rss_MiB_first_last": [after[0]["rss_MiB"], after[-1]["rss_MiB"]],
                      "open_fds_first_last": [after[0]["open_fds"], after[-1]["open_fds"]],
                      "rss_MiB_max_rise": round(max(a["rss_MiB"] for a in after) - after[0]["rss_MiB"], 1),
                      "open_fds_max_rise": max(a["open_fds"] for a in after) - after[0]["open_fds"]}
        out.append(entry)
    return out


def _spawn(root: str, out: str, progress: str, steps: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", root, out, progress, str(steps)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _last_step(progress: str) -> int:
    steps = [r["step"] for r in _records(progress) if "rss_MiB" in r]
    return steps[-1] if steps else -1


def main(steps: int = 300, kills: int = 5, json_path: str | None = None) -> dict:
    import torch
    from common import machine, write_json
    if os.geteuid() != 0:
        sys.exit("bench_soak.py --faults mounts a small tmpfs for the run directory: run it as root")
    work = tempfile.mkdtemp(prefix="soak-faults-")
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt)
    t0 = time.perf_counter()
    try:
        # 1. undisturbed
        ref_root, ref_out, ref_progress = os.path.join(work, "ref"), os.path.join(work, "ref.pt"), \
            os.path.join(work, "ref.jsonl")
        p = _spawn(ref_root, ref_out, ref_progress, steps)
        _, err = p.communicate()
        assert p.returncode == 0, f"the undisturbed run failed:\n{err}"
        ref_seconds = round(time.perf_counter() - t0, 1)
        print(f"undisturbed run: {steps} steps in {ref_seconds} s", file=sys.stderr, flush=True)
        # 2. the same on a small filesystem that fills up, killed and resumed
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", mnt], check=True)
        stop, fill_log = os.path.join(work, "stop"), os.path.join(work, "fill.log")
        filler = subprocess.Popen([sys.executable, "-c", FILLER, mnt, stop, fill_log])
        out, progress = os.path.join(work, "faults.pt"), os.path.join(work, "faults.jsonl")
        rng = random.Random(11)
        targets = sorted(rng.sample(range(SAVE_EVERY + 5, steps - 5), kills))
        killed_at, crashes, refused, t1 = [], [], 0, time.perf_counter()
        while True:
            before = _last_step(progress)
            job = _spawn(mnt, out, progress, steps)
            while job.poll() is None:
                if len(killed_at) < kills and _last_step(progress) >= targets[len(killed_at)]:
                    job.send_signal(signal.SIGKILL)
                    job.wait()
                    killed_at.append(_last_step(progress))
                    break
                time.sleep(0.02)
            if job.returncode == 0:
                break
            if job.returncode != -signal.SIGKILL:
                err = job.stderr.read()
                if _last_step(progress) == before and any(why in err for why in START_REFUSED):
                    refused += 1  # started while the disk was full: its swap does not fit; start it again
                    assert refused <= 100, f"the job never found room to start:\n{err[-2000:]}"
                    time.sleep(0.3)
                    continue
                crashes.append(err[-2000:])
                assert len(crashes) <= 3, "the job kept failing:\n" + "\n---\n".join(crashes)
        fault_seconds = round(time.perf_counter() - t1, 1)
        open(stop, "w").close()
        filler.wait(timeout=30)
        episodes = int(open(fill_log).read()) if os.path.exists(fill_log) else 0
        records = _records(progress)
        done = [r for r in records if r.get("event") == "done"][-1]
        resumed_from = [r["resumed"] for r in records if r.get("event") == "start"]
        # 3. compare
        a, b = torch.load(ref_out), torch.load(out)
        max_diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        equal = list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        per_process = _segments(records)
        failed_saves = sum(max((r["failed_saves"] for r in s_records), default=0)
                           for s_records in _by_process(records))
        result = {
            "benchmark": "soak-faults", "machine": machine(), "steps": steps, "save_every": SAVE_EVERY,
            "tmpfs": TMPFS_SIZE, "kills": len(killed_at), "killed_at_step": killed_at,
            "resumed_from": resumed_from, "starts_refused_disk_full": refused, "other_crashes": len(crashes),
            "crash_examples": [c[-600:] for c in crashes[:2]], "enospc_episodes": episodes,
            "failed_saves": failed_saves, "failed_save_examples": done["failed_saves"][:3],
            "bitwise_equal": equal, "max_abs_diff": max_diff,
            "undisturbed": {"seconds": ref_seconds, "per_process": _segments(_records(ref_progress))},
            "faulted": {"seconds": fault_seconds, "per_process": per_process},
        }
        write_json(json_path, result)
        assert equal, f"the parameters differ from the undisturbed run: max |diff| {max_diff}"
        return result
    finally:
        open(os.path.join(work, "stop"), "w").close()  # the filler stops (if it is still running)
        subprocess.run(["umount", "-l", mnt], check=False, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def _by_process(records: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    for r in records:
        if r.get("event") == "start":
            out.append([])
        elif "rss_MiB" in r and out:
            out[-1].append(r)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        from bench_soak import main as bench_main
        bench_main(["--faults", *sys.argv[1:]])
