"""Fine-tuning defaults of `infinity train` with `model.pretrained` (Note [fine-tuning defaults]).

Note [fine-tuning defaults]: the job's from-scratch defaults (lr 2e-3, weight decay on every parameter, fp32
compute) are wrong for a pretrained model. When `model.pretrained` is set and the user did not set the key:
`optimizer.lr` = 2e-5 (every weight trains) or 2e-4 (LoRA); `optimizer.no_decay = ["bias_and_norm"]` (HF
Trainer's rule; optimizer.weight_decay stays); `precision.compute_dtype` from config.json's `torch_dtype` /
`dtype`: bf16 -> bf16 (torch runs bf16 on CPU and CUDA), fp16 -> fp16 on CUDA but fp32 on CPU (fp16 matmuls
there are slow and need loss scaling for nothing). Each default is printed at the start with the key that
overrides it; a key the user set is never touched.

Note [from-scratch lr]: a model trained from random weights takes the job's lr (2e-3, right for the small models
a CPU trains) only up to d_model = 250; wider, `optimizer.lr` = 0.5 / d_model, unless set: the peak learning rate
falls with the width, as GPT-3's table (Brown et al. 2020, table 2.1: 6e-4 at d_model 768, 2e-4 at 2048, 1.2e-4
at 4096, 1e-4 at 5140) and as the widest models `infinity estimate --largest` names need (a 7B-wide Llama's
loss rose at 2e-3). Measured on the 2-core machine (2026-11-29: a 6 x 768 GPT, 60 steps of 8 x 128 bytes of the
default data): at 2e-3 the loss spiked (3.22 at step 20, 3.84 at 30) and ended at validation 2.88; at 0.5 / 768
= 6.5e-4 it fell smoothly to 2.63. Printed at the start as the fine-tuning defaults are.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

FULL_LR, LORA_LR = 2e-5, 2e-4
SCRATCH_LR_WIDTH = 0.5  # Note [from-scratch lr]: lr x d_model of a wide model trained from scratch
DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32",
          "fp32": "fp32"}


@dataclass(frozen=True)
class Default:
    section: str
    key: str
    value: object
    why: str
    kind: str = "fine-tuning"  # or "from-scratch" (Note [from-scratch lr])

    def line(self) -> str:
        return f"{self.kind} default: {self.section}.{self.key} = {json.dumps(self.value)} ({self.why}; " \
               f"--set {self.section}.{self.key}=... to change it)"


def checkpoint_dtype(pretrained: str) -> str | None:
    """config.json's torch_dtype / dtype as a precision.compute_dtype name, or None."""
    try:
        with open(os.path.join(pretrained, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or ""))


def pretrained_defaults(pretrained: str, lora_r: int, user: dict, *, cuda: bool | None = None) -> list[Default]:
    """The defaults that apply: those whose key is not in `user` ({section: {key: value}})."""
    if not pretrained:
        return []
    cuda = torch.cuda.is_available() if cuda is None else cuda
    out = [Default("optimizer", "lr", LORA_LR if lora_r else FULL_LR,
                   "LoRA fine-tuning" if lora_r else "full fine-tuning of a pretrained model"),
           Default("optimizer", "no_decay", ["bias_and_norm"], "no weight decay on biases and norm weights, as "
                   "HF Trainer")]
    dtype = checkpoint_dtype(pretrained)
    if dtype == "fp16" and not cuda:
        out.append(Default("precision", "compute_dtype", "fp32", "the checkpoint is float16, which is no good "
                           "default on CPU (slow, and needs loss scaling): fp32"))
    elif dtype in ("bf16", "fp16"):
        out.append(Default("precision", "compute_dtype", dtype, "the checkpoint's dtype in config.json"))
    return [d for d in out if d.key not in user.get(d.section, {})]


def scratch_defaults(d_model: int, lr: float, user: dict) -> list[Default]:
    """Note [from-scratch lr]: the lr of a model of width `d_model` trained from scratch where the job's `lr` is
    too high for it and the user set none."""
    wide = float(f"{SCRATCH_LR_WIDTH / d_model:.2g}")
    if wide >= lr or "lr" in user.get("optimizer", {}):
        return []
    return [Default("optimizer", "lr", wide, f"a model trained from scratch at d_model = {d_model}: "
                    f"{SCRATCH_LR_WIDTH} / d_model, the job's {lr:g} being for narrower ones", kind="from-scratch")]
