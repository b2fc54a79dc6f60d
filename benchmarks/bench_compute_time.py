"""The estimate's compute time (Note [compute time], infinity/memory/cost_model.py) against plain PyTorch.

For each GPT shape (`--shapes`, layers x width x sequence x micro-batch x vocabulary), the forward + backward of
the built-in GPT in plain PyTorch on this machine's CPU (the median of `--repeats` after two warm-ups) beside what
the estimator predicts for it: the trace's work (plan/traced.py `trace_step`: FLOPs, the other operations' bytes,
the operations) at the rates measured in the same run (the matmul rate on 1024 x 1024 and the elementwise rate, as
`infinity bench-links` measures them; the cost of an operation as the runtime probe measures it, remeasured). Also
the FLOPs alone at half the matmul rate (how the compute was priced before). `ratio` = measured / predicted.

    python benchmarks/bench_compute_time.py --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, write_json  # noqa: E402

SHAPES = ("2x16x16x2x64,2x64x64x4x256,4x128x128x8x4096,8x384x128x4x4096,4x256x256x8x4096,2x1024x128x4x4096,"
          "6x512x128x8x4096")


def plain_seconds(model, x, repeats: int) -> float:
    """Median seconds of a plain forward + backward after two warm-ups."""
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        model(x, x).backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated LAYERSxWIDTHxSEQxBATCHxVOCAB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from infinity.machine import link_rates
    from infinity.memory import cost_model
    from infinity.models.gpt import GPT, GPTConfig
    from infinity.plan import estimate as est
    from infinity.plan import probe
    cpu = torch.device("cpu")
    rates = cost_model.LinkRates(nvme_read=1.0, nvme_write=1.0, cpu_adam=1.0, device_adam=1.0,
                                 matmul_flops=link_rates._measure_matmul(cpu, torch.float32, 1024),
                                 memory_bw=link_rates._measure_elementwise(cpu, 1 << 23),
                                 op_seconds=probe.op_seconds(remeasure=True), source="this run")
    rows = []
    for shape in args.shapes.split(","):
        layers, width, seq, batch, vocab = (int(v) for v in shape.split("x"))
        cfg = GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=max(1, width // 64), d_model=width)
        with torch.device("meta"):
            meta = GPT(cfg)
        trace = est.trace_step(meta, lambda m, x, y: m(x, y), batch, seq)
        work = trace.step_work("none")
        model = GPT(cfg)
        measured = plain_seconds(model, torch.randint(0, vocab, (batch, seq)), args.repeats)
        predicted = cost_model.compute_seconds(work, rates)
        flops_only = work.flops / (rates.matmul_flops * 0.5)
        rows.append({"shape": shape, "flops": work.flops, "bytes": work.bytes, "ops": work.ops,
                     "measured_s": measured, "predicted_s": predicted, "ratio": measured / predicted,
                     "flops_only_s": flops_only, "flops_only_ratio": measured / flops_only})
        print(f"{shape:>20}  measured {measured * 1e3:9.2f} ms  predicted {predicted * 1e3:9.2f} ms  "
              f"ratio {measured / predicted:5.2f}  (FLOPs at half the matmul rate: {measured / flops_only:5.2f})",
              file=sys.stderr)
    ratios = [r["ratio"] for r in rows]
    write_json(args.json, {"benchmark": "compute_time", "machine": machine(), "load_average": os.getloadavg(),
                           "rates": {"matmul_flops": rates.matmul_flops, "memory_bw": rates.memory_bw,
                                     "op_seconds": rates.op_seconds},
                           "rows": rows, "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
