"""The runtime probe: what a run of infinity holds and spends beside its model, measured once in a fresh process.

A fresh Python imports torch, infinity and what the run imports beside them, trains a tiny model, and reports its
RSS (Note [peak memory]'s `runtime` term), its steady step less the same model's plain forward + backward (Note
[host time]) and the host's seconds per operation (Note [compute time]); cached per machine, torch version,
version of infinity's code and set of packages (machine/link_rates.py's `cached_measurement`). `infinity
estimate` (estimate.py) reads it through `runtime_rss`, `host_time` and `op_seconds`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from infinity.machine import link_rates
from infinity.machine.preflight import PreflightError

_RUNTIME_PROBE = """
import importlib, json, pathlib, subprocess, sys, tempfile, time
import psutil, torch, infinity
backend = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--compile=")), None)
for name in (a for a in sys.argv[1:] if not a.startswith(("--", "read:"))):  # what the run imports beyond them
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # (the run itself says what is missing)
reads = [a[len("read:"):] for a in sys.argv[1:] if a.startswith("read:")]
if reads:  # the data's record files, read as the run reads them (its reader imports their libraries); written by
    # another process (pyarrow's writer held ~67 MiB that a run, which only reads, does not)
    from infinity.config.options import ConfigError
    from infinity.data.sources import stream_records
    with tempfile.TemporaryDirectory() as where:
        for suffix in reads:
            write = f"import pathlib; from infinity.data.sources import write_sample; write_sample({suffix!r}, " \
                    f"pathlib.Path({where!r}))"
            if subprocess.run([sys.executable, "-c", write], capture_output=True).returncode:
                continue  # (a missing library: the run itself says what is missing)
            try:
                for _ in stream_records(pathlib.Path(where) / f"sample{suffix}", "data.path"):
                    pass
            except (ImportError, ConfigError):
                pass
from infinity.models.gpt import GPT, GPTConfig
with infinity.meta_init():  # meta tensors load torch's meta kernels (tens of MiB), as every real run does
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16))
with infinity.initialize(model, {"compile": {"units": True, "backend": backend}} if backend else {}) as engine:
    x = torch.randint(0, 64, (2, 16))
    seconds = []
    for _ in range(8):
        t0 = time.perf_counter()
        engine.backward(engine(x, x))
        engine.step()
        seconds.append(time.perf_counter() - t0)
    rss, units = psutil.Process().memory_info().rss, len(engine.units)
# the same model in plain PyTorch (Note [compute time]): its forward + backward is its operations' host cost (its
# FLOPs and bytes are nil), counted as the estimate's trace counts them
from infinity.plan.traced import FlopCount
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
plain, x = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16)).to(device), x.to(device)
def plain_step():
    t0 = time.perf_counter()
    plain(x, x).backward()
    plain.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
with FlopCount() as count:
    plain_step()
plain_s = min([plain_step() for _ in range(15)][2:])
print(json.dumps({"rss": rss, "units": units, "step_s": min(seconds[1:]), "first_step_s": seconds[0],
                  "plain_s": plain_s, "op_s": plain_s / count.ops}))
"""




def runtime_probe(remeasure: bool = False, modules: tuple[str, ...] = (), compiled: str | None = None) -> dict:
    """Note [peak memory] runtime and Note [host time]: a fresh process after torch, infinity, `modules` (what the run
    imports beyond them: models/build.py's `runtime_modules`, e.g. transformers' modeling code, ~160 MiB; and
    `read:SUFFIX`, a sample record file of that kind read as the run reads its data: data/tokenized.py's
    `reader_modules`) and their kernels are loaded builds a tiny model on the meta device and trains it for eight
    steps: its RSS ("rss"), its units, the fastest of steps 2-8 ("step_s") and step 1 ("first_step_s"); then the
    same model's forward + backward in plain PyTorch, the fastest of 13 ("plain_s", its operations' host cost: the
    model's FLOPs and bytes are nil) and that over the operations it ran ("op_s", Note [compute time]). The fastest,
    not the median: measured once and cached, a median of five taken while other processes held both cores read
    0.57 s for a 2 ms plain step (2026-11-29, the test suite on two workers). Measured once per machine,
    torch version, version of infinity's code (what a run imports is the code's: torch._dynamo's import, gone on
    2026-11-26, was 71 MiB of it) and set of packages the modules are of, then cached. `compiled`: the [compile]
    backend when the run compiles its units (Note [compiled units]): the probe compiles its tiny model's units
    with it, so torch._dynamo's and the backend's import and a compile are in its RSS (+190 MiB for inductor on
    2026-11-28, a 2 x 64 GPT on the CPU: the estimate was 1.75x under without it). A probe that fails is an error
    naming it."""
    def measure() -> dict:
        try:
            flags = [f"--compile={compiled}"] if compiled else []
            out = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE, *modules, *flags], capture_output=True,
                                 text=True, check=True, timeout=300, env={**os.environ, "WORLD_SIZE": "1"})
        except subprocess.CalledProcessError as e:
            raise PreflightError(f"the runtime memory probe failed (a fresh python importing torch and infinity): "
                               f"{(e.stderr or '').strip().splitlines()[-1:] or e.returncode}; run "
                               f"python -c 'import torch, infinity' to see why") from None
        return json.loads(out.stdout.strip().splitlines()[-1])
    # keyed by the packages (transformers, peft, ...), not each module: one model's modeling code or a tokenizer
    # more weighs a few MiB beside the ~160 MiB of the package itself, and each probe is a process of its own
    packages = sorted({m if m.startswith("read:") else m.split(".")[0] for m in modules})
    name = ("runtime_probe" + (f"|{','.join(packages)}" if packages else "")
            + (f"|compile={compiled}" if compiled else ""))
    return dict(link_rates.cached_measurement(name, measure, remeasure=remeasure, of_code=True))


def runtime_rss(remeasure: bool = False, modules: tuple[str, ...] = (), compiled: str | None = None) -> int:
    """Note [peak memory] runtime: the probe's RSS (`runtime_probe`)."""
    return int(runtime_probe(remeasure, modules, compiled)["rss"])


def host_time(units: int, remeasure: bool = False, modules: tuple[str, ...] = (),
              compiled: str | None = None) -> tuple[float, float]:
    """Note [host time]: (seconds per steady step, extra seconds of the first step) the engine's host work adds to
    the byte model's step for a model of `units` units: the probe's step less its model's plain forward + backward
    (the model's own operations, Note [compute time]), scaled by units (its work is per unit: the hooks, the
    gathers, the update's calls). The first step's extra is a floor: a large model's first step also faults in its
    state's pages and creates its swap files, which the probe's tiny one does not."""
    probe = runtime_probe(remeasure, modules, compiled)
    scale = units / max(1, int(probe.get("units", 1)))
    return (max(0.0, probe["step_s"] - probe["plain_s"]) * scale,
            max(0.0, probe["first_step_s"] - probe["step_s"]) * scale)


def op_seconds(remeasure: bool = False, modules: tuple[str, ...] = (), compiled: str | None = None) -> float:
    """Note [compute time]: the host's seconds per operation of a model's forward + backward (the probe's)."""
    return float(runtime_probe(remeasure, modules, compiled)["op_s"])
