"""The compute dtypes a config names ("fp32", "bf16", "fp16") as torch dtypes: the one map."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of `precision.compute_dtype` = `name` (validated by the config), or of a dtype a user
    names to an engine call (ValueError naming the choices)."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: use one of {', '.join(map(repr, DTYPES))} or a torch dtype")
    return DTYPES[name]


def name_of(dtype: torch.dtype) -> str:
    """The config name ("fp32", "bf16", "fp16") of one of DTYPES' dtypes (e.g. a checkpoint record's)."""
    return next(name for name, d in DTYPES.items() if d == dtype)
