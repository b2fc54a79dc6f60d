"""A training run that checkpoints every 2 steps and resumes from the newest complete checkpoint.

    python kill_worker.py ROOT [--kill-at SITE:STEP:N] [--background]

Kill sites (SIGKILL to itself, like an OOM kill or a node failure):
  forward:S:0 / backward:S:0 / step:S:0   during optimizer step S's forward, backward, update
  write:S:N                               at the N-th file write of the checkpoint saved after step S
  commit:S:0                              after the rank files are durable, right before the rename
Writes ROOT/final.pt (the full state dict) when it completes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import infinity  # noqa: E402
import infinity.state.checkpoint as ckpt_mod  # noqa: E402
import infinity.state.checkpoint_load as load_mod  # noqa: E402
from reference import Recipe  # noqa: E402

RECIPE = Recipe(steps=6)
SAVE_EVERY = 2


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def latest_checkpoint(root: str) -> str | None:
    best, best_step = None, -1
    ckpts = os.path.join(root, "ckpts")
    for name in os.listdir(ckpts) if os.path.isdir(ckpts) else []:
        path = os.path.join(ckpts, name)
        try:
            manifest = load_mod.read_manifest(path)
        except ckpt_mod.CheckpointError:
            continue  # a partial save: never loaded
        if manifest["user_state"]["next_step"] > best_step:
            best, best_step = path, manifest["user_state"]["next_step"]
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--kill-at", default="")
    ap.add_argument("--background", action="store_true")
    args = ap.parse_args()
    site, kill_step, kill_n = (args.kill_at.split(":") + ["", "-1", "0"])[:3] if args.kill_at else ("", "-1", "0")
    kill_step, kill_n = int(kill_step), int(kill_n)
    swap = os.path.join(args.root, "swap")
    os.makedirs(swap, exist_ok=True)
    cfg = RECIPE.config(params="nvme", grads="nvme", optimizer="nvme")
    cfg["nvme"] = {"paths": [swap]}
    cfg["checkpoint"] = {"keep_last": 2, "background": args.background}
    engine = infinity.initialize(RECIPE.build(), cfg)
    start = 0
    resume = latest_checkpoint(args.root)
    complete = None
    if resume:
        complete = os.path.isfile(os.path.join(resume, "manifest.json"))  # (keep_last may remove it later)
        start = engine.load_checkpoint(resume)["next_step"]
    if site == "write":
        real_submit, count = ckpt_mod.IOEngine.submit_write, {"n": 0}

        def submit_write(self, tensor, path, offset=0, **kw):
            if f"step-{kill_step + 1}.tmp-" in str(path):  # a write of that save (maybe from its background thread)
                count["n"] += 1
                if count["n"] == kill_n:
                    die()
            return real_submit(self, tensor, path, offset, **kw)
        ckpt_mod.IOEngine.submit_write = submit_write
    if site == "commit":
        real_rename = ckpt_mod.os.rename

        def rename(a, b):
            if f"step-{kill_step + 1}.tmp-" in str(a):
                die()
            real_rename(a, b)
        ckpt_mod.os.rename = rename
    for step in range(start, RECIPE.steps):
        for x, y in RECIPE.batches()[step]:
            if site == "forward" and step == kill_step:
                die()
            loss = engine(x, y)
            if site == "backward" and step == kill_step:
                die()
            engine.backward(loss)
            if site == "step" and step == kill_step:
                die()
            engine.step()
        if (step + 1) % SAVE_EVERY == 0:
            engine.save_checkpoint(os.path.join(args.root, "ckpts", f"step-{step + 1}"),
                                   user_state={"next_step": step + 1})
    state = engine.full_state_dict()
    engine.close()
    torch.save(state, os.path.join(args.root, "final.pt"))
    print(json.dumps({"resumed_from": resume, "resumed_complete": complete, "start": start}))


if __name__ == "__main__":
    main()
